from groupwise.cli import main

raise SystemExit(main())

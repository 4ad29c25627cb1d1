"""Pure GRPO math. Every module here imports torch only: no config objects, no I/O, no globals.

Shape glossary (used in every docstring and shape comment):
    B  prompts in a batch          G  completions per prompt (the group)
    N  rows = completions (B*G, or a process's slice of them)
    T  completion tokens (padded)  V  vocabulary size
"""

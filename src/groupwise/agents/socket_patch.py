"""Run (from its text, `python -c`) instead of `main.py` by groupwise.agents.sandbox when the network must be blocked
and no network namespace could be had: ordinary Python code gets PermissionError from socket.socket for anything but
Unix sockets. Easy to bypass (ctypes, _socket, a subprocess): reported as network="python-socket-patch", never as
isolation. Never imported.
"""
def _block_network():
    import socket
    local = (socket.AF_UNIX, getattr(socket, "AF_NETLINK", -2))
    class socket_without_network(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family not in local:
                raise PermissionError(13, "network access is disabled in this sandbox")
            super().__init__(family, type, proto, fileno)
    socket.socket = socket_without_network
_block_network()
del _block_network
import sys
sys.argv = ["main.py"]
__file__ = "main.py"
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code)

"""Loaded by every Python process the tests start (PYTHONPATH): any connection beyond this machine fails loudly.

yoloaccum must download nothing at run time (weights, fonts, datasets, analytics); this makes a try visible.
Loopback stays open for torchrun's rendezvous and gloo.
"""

import socket

_LOCAL = ("127.", "localhost", "::1", "0.0.0.0")
_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo


def _is_local(address) -> bool:
    host = address[0] if isinstance(address, tuple) else address
    return not isinstance(host, str) or host.startswith(_LOCAL) or host == "" or "/" in host


def _guard(real):
    def guarded(self, address):
        if self.family != socket.AF_UNIX and not _is_local(address):
            raise OSError(f"yoloaccum tests: network access to {address} is blocked")
        return real(self, address)

    return guarded


def _getaddrinfo_local(host, *args, **kwargs):
    if host is not None and not _is_local((host,)) and host != socket.gethostname():
        raise socket.gaierror(f"yoloaccum tests: name lookup of {host} is blocked")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect = _guard(_connect)
socket.socket.connect_ex = _guard(_connect_ex)
socket.getaddrinfo = _getaddrinfo_local

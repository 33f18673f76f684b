"""A "second host" on this machine: a network namespace with its own address, joined to the host by
a veth pair, for benchmarks that run services apart from Redis (bench/tokenizer_scaling.py).

    host  psb-h 10.231.0.1/30  <-- veth -->  psb-n 10.231.0.2/30  (namespace NAME, plus its own lo)

Processes started with ``exec_argv`` see only the namespace's interfaces: the host's loopback is
out of reach, so whatever they use must listen on the host side's address. Needs root (ip netns).
``NetNamespace`` removes the namespace (and so the veth pair) on exit, also after an error, and
removes a leftover of the same name before it starts.
"""

from __future__ import annotations

import subprocess


class NetNamespace:
    """Owns one network namespace and its veth pair for the duration of a ``with`` block."""

    def __init__(self, name: str, host_if: str = "psb-h", ns_if: str = "psb-n", subnet: str = "10.231.0"):
        self.name, self.host_if, self.ns_if = name, host_if, ns_if
        self.host_address, self.ns_address = f"{subnet}.1", f"{subnet}.2"

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def __enter__(self) -> NetNamespace:
        self.remove()
        try:
            for cmd in (["ip", "netns", "add", self.name],
                        ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                        ["ip", "link", "set", self.ns_if, "netns", self.name],
                        ["ip", "addr", "add", f"{self.host_address}/30", "dev", self.host_if],
                        ["ip", "link", "set", self.host_if, "up"],
                        self.exec_argv(["ip", "addr", "add", f"{self.ns_address}/30", "dev", self.ns_if]),
                        self.exec_argv(["ip", "link", "set", self.ns_if, "up"]),
                        self.exec_argv(["ip", "link", "set", "lo", "up"])):
                subprocess.run(cmd, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            self.remove()
            raise RuntimeError(f"network namespace set-up failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Delete the namespace (its end of the pair goes with it, and with it the host's end)."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

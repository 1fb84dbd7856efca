"""Network namespaces joined by shaped veth links to one bridge: a cluster on one machine.

Rank i lives in namespace ``<prefix><i>`` with interface ``eth0`` at
``10.77.0.<i+1>/24``; its veth peer ``<prefix>v<i>`` sits on bridge
``<prefix>br`` in the root namespace.  Both directions of every link are
shaped with ``tbf`` (rate), on ``eth0`` inside the namespace (what the rank
sends) and on the host-side peer (what it receives); with a delay or jitter
a ``netem`` root sits above the ``tbf``.  (The kernel of our 2-core machines
has no ``sch_netem``: delay is refused there with a clear error, and slow-link
stragglers are made by lowering one rank's rate instead.)  Everything it creates carries the prefix, so a
leftover of a crashed run is removed before the next run starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.77.0"


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, or no ``ip``/``tc``)."""


def parse_rate(text: str | float) -> float:
    """Bits per second from ``1gbit``, ``500mbit``, ``10g`` or a number.

    Example:
        >>> parse_rate("1gbit"), parse_rate("250mbit")
        (1000000000.0, 250000000.0)
    """
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps|b)?\s*", text.lower())
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 1gbit, 500mbit, 10g")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """``None`` when namespaces can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (Debian package iproute2)"
    return None


@dataclass
class Cluster:
    """``ranks`` namespaces on a bridge, links shaped to ``rate_bps`` (context manager).

    Example:
        >>> with Cluster(4, parse_rate("1gbit"), delay_ms=0.5) as cl:   # doctest: +SKIP
        ...     cl.set_rate(2, 250e6)         # rank 2's link becomes a 4x straggler
    """

    ranks: int
    rate_bps: float
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    prefix: str = "cl"
    #: jumbo frames: less per-packet CPU on a 2-core host, headers ~1 % of what tbf counts
    mtu: int = 9000

    def ns(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def _peer(self, rank: int) -> str:
        return f"{self.prefix}v{rank}"

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> Cluster:
        why = available()
        if why:
            raise ClusterUnavailable(why)
        self.teardown()
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _setup(self) -> None:
        if not 1 <= self.ranks <= 200:
            raise ValueError(f"ranks {self.ranks}: expected 1..200")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for r in range(self.ranks):
            ns, peer = self.ns(r), self._peer(r)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", peer, "mtu", str(self.mtu), "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu), "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            for prefix, dev in ((("ip", "netns", "exec", ns), "eth0"), ((), peer)):
                self._shape(prefix, dev, self.delay_ms, self.jitter_ms)

    def _tbf(self, rate_bps: float) -> list[str]:
        # burst: at least 256 KiB (several TSO segments) and 1 ms worth of the rate,
        # so that the kernel's timer granularity does not cap the rate
        burst = max(1 << 20, int(rate_bps / 8 / 250))
        return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms"]

    def _shape(self, prefix: tuple[str, ...], dev: str, delay_ms: float, jitter_ms: float) -> None:
        if delay_ms or jitter_ms:  # netem root (delay) with the tbf (rate) below it
            netem = ["netem", "delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
            res = _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem,
                       "limit", "100000", check=False)
            if res.returncode != 0:
                raise ClusterUnavailable(
                    f"netem (link delay) is not available in this kernel: {res.stderr.strip()}; "
                    "run without --delay/--jitter")
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:",
                 *self._tbf(self.rate_bps))
        else:
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                 *self._tbf(self.rate_bps))

    def set_rate(self, rank: int, rate_bps: float) -> None:
        """Change rank's link rate both ways (a slow-link straggler; ``rate_bps`` to restore)."""
        parent = ("parent", "1:", "handle", "2:") if self.delay_ms or self.jitter_ms \
            else ("root", "handle", "1:")
        for prefix, dev in ((("ip", "netns", "exec", self.ns(rank)), "eth0"), ((), self._peer(rank))):
            _run(*prefix, "tc", "qdisc", "change", "dev", dev, *parent, *self._tbf(rate_bps))

    def teardown(self) -> None:
        """Remove every namespace and link with this prefix (also a crashed run's)."""
        out = _run("ip", "netns", "list", check=False).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            if re.fullmatch(rf"{re.escape(self.prefix)}\d+", name):
                _run("ip", "netns", "del", name, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout
        for m in re.finditer(rf"^\d+: ({re.escape(self.prefix)}(?:v\d+|br))[@:]", links, re.M):
            _run("ip", "link", "del", m.group(1), check=False)

    def leftovers(self) -> list[str]:
        """Names of this prefix's namespaces and links that still exist."""
        names = [ln.split()[0] for ln in _run("ip", "netns", "list", check=False).stdout.splitlines()
                 if ln.split() and re.fullmatch(rf"{re.escape(self.prefix)}\d+", ln.split()[0])]
        links = _run("ip", "-o", "link", "show", check=False).stdout
        names += re.findall(rf"^\d+: ({re.escape(self.prefix)}(?:v\d+|br))[@:]", links, re.M)
        return names

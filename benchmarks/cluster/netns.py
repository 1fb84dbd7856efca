"""Network namespaces joined by shaped veth links to one bridge: a cluster on one machine.

Rank ``i`` lives in namespace ``<prefix><i>`` (default prefix ``cl-``) with
interface ``eth0`` at ``10.77.0.<i+1>/24``; its veth peer ``<prefix>v<i>``
sits on bridge ``<prefix>br`` in the root namespace, which has no address of
its own, so the traffic never leaves the namespaces this module made.

Every link is shaped both ways with ``tbf`` (see :func:`tbf_params`): on
``eth0`` inside the namespace (the rank's uplink, what it sends) and on the
host-side peer (the downlink, what it receives), like a host port and a switch
port of a full-duplex network.  A link delay (``delay_ms``, ``jitter_ms``) is
a ``netem`` root above the uplink's ``tbf``, so the one-way rank-to-rank delay
is ``delay_ms``.  Kernels without ``sch_netem`` (this project's 2-core
machines: ``CONFIG_NET_SCH_NETEM`` is not set) refuse a delay with
:class:`NetemUnavailable`; lowering one rank's rate still makes a slow link.

Everything carries the prefix: a run takes a lock on it (so that two runs with
one prefix cannot tear each other down), then removes what a crashed run left
behind (its processes inside the namespaces included) before building.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

SUBNET = "10.77.0"
LOCK_DIR = "/run/lock" if os.path.isdir("/run/lock") else "/tmp"


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, or no ``ip``/``tc``).

    Example:
        >>> raise ClusterUnavailable("not root")   # doctest: +SKIP
    """


class NetemUnavailable(ClusterUnavailable):
    """A link delay was asked for, but this kernel has no ``sch_netem``.

    Example:
        >>> issubclass(NetemUnavailable, ClusterUnavailable)
        True
    """


class ClusterBusy(RuntimeError):
    """Another live run holds this prefix (its lock file under ``LOCK_DIR``).

    Example:
        >>> raise ClusterBusy("prefix 'cl-' is in use")   # doctest: +SKIP
    """


def parse_rate(text: str | float) -> float:
    """Bits per second from ``1gbit``, ``500mbit``, ``10g``, ``2.5gbps`` or a number.

    Example:
        >>> parse_rate("1gbit"), parse_rate("250mbit"), parse_rate(5e8)
        (1000000000.0, 250000000.0, 500000000.0)
    """
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps|b)?\s*", text.lower())
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 1gbit, 500mbit, 10g")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def parse_ms(text: str | float) -> float:
    """Milliseconds from ``1ms``, ``100us``, ``0.5`` (ms) or ``1s``.

    Example:
        >>> parse_ms("1ms"), parse_ms("100us"), parse_ms("2"), parse_ms(0.5)
        (1.0, 0.1, 2.0, 0.5)
    """
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|us|s)?\s*", text.lower())
    if not m:
        raise ValueError(f"time {text!r}: expected e.g. 1ms, 100us, 0.5")
    return float(m.group(1)) * {None: 1.0, "ms": 1.0, "us": 1e-3, "s": 1e3}[m.group(2)]


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Hold off SIGINT, SIGTERM and SIGHUP (in the main thread) so that a cleanup runs to its end.

    Example:
        >>> with signals_blocked():
        ...     pass
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


#: the largest packet TCP hands a veth (a GSO super-packet) plus headers
GSO_MAX_BYTES = 65536 + 4096


def tbf_params(rate_bps: float, mtu: int = 9000, burst: int | None = None) -> dict[str, int]:
    """``tbf`` bucket (``burst``) and queue (``limit``) in bytes for a link of ``rate_bps``.

    ``burst`` is the error term: an idle link banks up to ``burst`` bytes and
    then passes them at memory speed, so idle gaps inside a collective are
    partly refunded; smaller is more faithful.  But it must hold a whole GSO
    super-packet (64 KiB): ``tbf`` cuts any packet larger than its bucket into
    MTU-sized segments in software, which on a 2-core host triples the softirq
    time (4 ranks at 1 Gbit/s, 16 MiB allreduce: 0.81x of the ring bound with a
    62500-byte bucket, 0.83-0.90x with 68 KiB; with 1 MiB a 4 MiB allreduce
    meets the bound exactly, which a real link cannot).  And it must cover
    0.5 ms of the rate, so that a late timer wake-up does not lose tokens (this
    decides above ~1.1 Gbit/s).  ``limit`` holds 50 ms of the rate (at least
    256 KiB): TCP never loses a packet at the shaper (a loss would cost a 200 ms
    retransmission timeout; TCP small queues keep the standing queue far below).
    ``burst`` overrides the rule (``--burst``, for measuring it).

    Example:
        >>> tbf_params(1e9)
        {'burst': 69632, 'limit': 6250000}
    """
    burst = burst or max(GSO_MAX_BYTES, 4 * (mtu + 100), int(rate_bps / 8 * 0.5e-3))
    limit = max(256 << 10, int(rate_bps / 8 * 50e-3))
    return {"burst": burst, "limit": limit}


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}: {res.stderr.strip()}")
    return res


def available() -> str | None:
    """``None`` when namespaces can be made here, else the reason why not.

    Example:
        >>> available() in (None,) or isinstance(available(), str)
        True
    """
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (Debian package iproute2)"
    return None


@dataclass
class Cluster:
    """``ranks`` namespaces on a bridge, links shaped to ``rate_bps`` (a context manager).

    Example:
        >>> with Cluster(4, parse_rate("1gbit")) as cl:   # doctest: +SKIP
        ...     cl.set_link(2, rate_bps=250e6)     # rank 2's link becomes a 4x straggler
        ...     cl.set_link(2)                     # and back to the configured link
    """

    ranks: int
    rate_bps: float
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    prefix: str = "cl-"
    #: jumbo frames: less per-packet CPU on a 2-core host, headers ~0.7 % of what tbf counts
    mtu: int = 9000
    #: tbf bucket in bytes; ``None``: :func:`tbf_params`' rule
    burst: int | None = None
    #: a netem root on every uplink even at zero delay, so that a delay can be set later
    netem: bool = False
    _lock: IO[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,7}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: 1-8 of [a-z0-9-], starting with a letter")
        if not 1 <= self.ranks <= 250:
            raise ValueError(f"ranks {self.ranks}: expected 1..250")

    def ns(self, rank: int) -> str:
        """The namespace of ``rank``.

        Example:
            >>> Cluster(4, 1e9).ns(2)
            'cl-2'
        """
        return f"{self.prefix}{rank}"

    def address(self, rank: int) -> str:
        """The address of ``rank``'s ``eth0``.

        Example:
            >>> Cluster(4, 1e9).address(0)
            '10.77.0.1'
        """
        return f"{SUBNET}.{rank + 1}"

    @property
    def bridge(self) -> str:
        """The bridge in the root namespace.

        Example:
            >>> Cluster(4, 1e9).bridge
            'cl-br'
        """
        return f"{self.prefix}br"

    def peer(self, rank: int) -> str:
        """The root-namespace end of ``rank``'s veth pair (its downlink is shaped here).

        Example:
            >>> Cluster(4, 1e9, prefix="cx-").peer(3)
            'cx-v3'
        """
        return f"{self.prefix}v{rank}"

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> Cluster:
        why = available()
        if why:
            raise ClusterUnavailable(why)
        self._take_lock()
        try:
            self.teardown()
            self._setup()
        except BaseException:
            with signals_blocked():
                self.teardown()
                self._release_lock()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with signals_blocked():  # a second Ctrl-C must not leave half a cluster behind
            try:
                self.teardown()
            finally:
                self._release_lock()

    def _take_lock(self) -> None:
        path = os.path.join(LOCK_DIR, f"commlib-cluster-{self.prefix}.lock")
        f = open(path, "a+")  # noqa: SIM115 - held until __exit__
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ClusterBusy(f"another run holds prefix {self.prefix!r} ({path}); "
                              "pick another --prefix or wait") from None
        self._lock = f

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # the kernel drops the flock; a killed run's lock goes the same way
            self._lock = None

    def _setup(self) -> None:
        self.netem = self.netem or bool(self.delay_ms or self.jitter_ms)
        br = self.bridge
        # nf_call_*=0: bridged frames skip the root namespace's netfilter (br_netfilter would
        # run conntrack on every frame and obey a host firewall's FORWARD policy)
        if _run("ip", "link", "add", br, "type", "bridge", "nf_call_iptables", "0",
                "nf_call_ip6tables", "0", "nf_call_arptables", "0", check=False).returncode:
            _run("ip", "link", "add", br, "type", "bridge")
        # addrgenmode none: no IPv6 link-local address on the bridge and its ports, so the
        # root namespace gets no address at all on the cluster
        _run("ip", "link", "set", br, "addrgenmode", "none", check=False)
        _run("ip", "link", "set", br, "up")
        for r in range(self.ranks):
            ns, peer = self.ns(r), self.peer(r)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", peer, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns)
            _run("ip", "link", "set", peer, "addrgenmode", "none", check=False)
            _run("ip", "link", "set", peer, "master", br, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "addrgenmode", "none", check=False)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(r, self.rate_bps, self.delay_ms, self.jitter_ms, "add")

    def _tc(self, rank: int, uplink: bool, *opts: str) -> tuple[str, ...]:
        return ("tc", *opts, "-n", self.ns(rank), "qdisc") if uplink else ("tc", *opts, "qdisc")

    def _tbf(self, rate_bps: float) -> list[str]:
        p = tbf_params(rate_bps, self.mtu, self.burst)
        return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(p["burst"]),
                "limit", str(p["limit"])]

    def _shape(self, rank: int, rate_bps: float, delay_ms: float, jitter_ms: float,
               verb: str) -> None:
        for uplink, dev in ((True, "eth0"), (False, self.peer(rank))):
            tc = self._tc(rank, uplink)
            if uplink and self.netem:  # netem root (delay) with the tbf (rate) below it
                netem = ["netem", "delay", f"{delay_ms}ms"] + \
                    ([f"{jitter_ms}ms", "distribution", "normal"] if jitter_ms else []) + \
                    ["limit", str(1 << 20)]
                res = _run(*tc, verb, "dev", dev, "root", "handle", "1:", *netem, check=False)
                if res.returncode:
                    raise NetemUnavailable(
                        f"a link delay needs the netem qdisc, which this kernel lacks "
                        f"({res.stderr.strip()}; CONFIG_NET_SCH_NETEM); run without link "
                        "delays (--delay, --jitter, --straggler-link R:5ms:..), or make a slow "
                        "link with a lower rate (--straggler-link R:x4:..)")
                _run(*tc, verb, "dev", dev, "parent", "1:1", "handle", "10:",
                     *self._tbf(rate_bps))
            else:
                _run(*tc, verb, "dev", dev, "root", "handle", "1:", *self._tbf(rate_bps))

    def set_link(self, rank: int, rate_bps: float | None = None,
                 delay_ms: float | None = None, jitter_ms: float | None = None) -> None:
        """Change ``rank``'s link; what is left ``None`` goes back to the configured value.

        A delay needs ``netem``: only a cluster made with a delay or ``netem=True``
        can change one later.

        Example:
            >>> cl.set_link(1, rate_bps=100e6)   # doctest: +SKIP
            >>> cl.set_link(1)                   # doctest: +SKIP
        """
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank}: this cluster has ranks 0..{self.ranks - 1}")
        delay = self.delay_ms if delay_ms is None else delay_ms
        jitter = self.jitter_ms if jitter_ms is None else jitter_ms
        if (delay or jitter) and not self.netem:
            raise NetemUnavailable("a delay can be changed only on a cluster made with a "
                                   "delay or netem=True; lower the rate instead")
        self._shape(rank, self.rate_bps if rate_bps is None else rate_bps, delay, jitter, "change")

    def stats(self, rank: int) -> dict[str, dict[str, int]]:
        """Bytes, packets and drops the shapers of ``rank`` saw (``uplink`` and ``downlink``).

        Example:
            >>> cl.stats(0)["uplink"]["dropped"]   # doctest: +SKIP
            0
        """
        out = {}
        for name, uplink, dev in (("uplink", True, "eth0"), ("downlink", False, self.peer(rank))):
            text = _run(*self._tc(rank, uplink, "-s"), "show", "dev", dev, check=False).stdout
            m = re.search(r"qdisc tbf .*?Sent (\d+) bytes (\d+) pkt \(dropped (\d+), "
                          r"overlimits (\d+)", text, re.S)
            keys = ("bytes", "packets", "dropped", "overlimits")
            out[name] = dict(zip(keys, map(int, m.groups()))) if m else {}
        return out

    def teardown(self, wait_s: float = 10.0) -> None:
        """Remove every namespace and link with this prefix (a crashed run's too).

        Processes still inside the namespaces are killed first: a namespace with
        a process in it outlives ``ip netns del``.

        Example:
            >>> Cluster(1, 1e9, prefix="cl-").teardown()   # doctest: +SKIP
        """
        for ns in self._namespaces():
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for link in self._links():  # deleting one end of a veth pair removes both, synchronously
            if link != self.bridge:
                _run("ip", "link", "del", link, check=False)
        if self.bridge in self._links():
            _run("ip", "link", "del", self.bridge, check=False)
        for ns in self._namespaces():
            _run("ip", "netns", "del", ns, check=False)
        deadline = time.monotonic() + wait_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        if left := self.leftovers():
            raise RuntimeError(f"could not remove {left}")

    def _namespaces(self) -> list[str]:
        out = _run("ip", "netns", "list", check=False).stdout
        names = [ln.split()[0] for ln in out.splitlines() if ln.split()]
        return [n for n in names if re.fullmatch(rf"{re.escape(self.prefix)}\d+", n)]

    def _links(self) -> list[str]:
        out = _run("ip", "-o", "link", "show", check=False).stdout
        return re.findall(rf"^\d+: ({re.escape(self.prefix)}(?:v\d+|br))[@:]", out, re.M)

    def leftovers(self) -> list[str]:
        """Names of this prefix's namespaces and links that exist now.

        Example:
            >>> Cluster(4, 1e9).leftovers()   # doctest: +SKIP
            []
        """
        return self._namespaces() + self._links()

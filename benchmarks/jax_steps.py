"""What the JAX binding's training steps cost: each way of stepping an optax optimizer, side by side.

A JAX MLP (``--hidden`` wide, two hidden layers, about 1.9M float32
parameters at the default) trains on random data, batch ``--batch`` per rank,
plain SGD with momentum. Contenders, one step each (the gradient jitted, the
update called as the contender needs):

* ``local``: no communication (the jitted optax update): the floor;
* ``average``: ``optax.chain(average_gradients(), sgd)``, called eagerly (one
  fused all-reduce of the gradients);
* ``raw``: ``local`` plus one mpi4py ``Allreduce`` of the gradients packed by
  numpy into one buffer: what an all-reduce step costs without commlib;
* ``dopt-allreduce``: ``DistributedOptimizer(sgd, AllReduce())``: the
  transformation of the parameter path on a strategy that reads no
  parameters (the gradients packed, averaged, unpacked, as ``average``);
* ``selsync-bsp``: ``SelSync(delta=0, mode="grads")``, synchronized every step;
* ``selsync-local``: ``SelSync(delta=inf, warmup=0)``: local steps (the gate's
  norm and its one-element flag all-reduce each step; the model never travels);
* ``syncswitch-asp``: ``SyncSwitch`` in ASP from the first step: each step
  pushes its change into the parameter store and pulls it back;
* ``sharded``: ``sharded_optimizer(sgd, DeAR())``: ZeRO-1 (reduce-scatter, the
  update on this rank's shard, all-gather of the updates);
* ``sharded-clip``: ``sharded_optimizer(optax.chain(clip_by_global_norm(1.0), sgd))``:
  ``sharded`` plus the global norm summed over the ranks' shards (one scalar all-gather);
* ``...-jit`` (``local``, ``average``, ``selsync-bsp``, ``selsync-local``,
  ``syncswitch-asp``, ``sharded``, ``sharded-clip``): the same, with the whole step (gradient, update, the
  updates applied) one ``jax.jit`` call: ``DistributedOptimizer.update`` as
  its ordered callbacks (``sharded_optimizer``'s update likewise).

Ratios: each contender's step over ``average``'s and over ``local``'s (a jitted one's over
``average-jit``'s and ``local-jit``'s): ``selsync-bsp / average`` is what the gate adds to an
all-reduce step, ``selsync-local / local`` what a local step of SelSync costs over a plain one.

Example:
    timeout 600 mpiexec -n 2 python -m benchmarks.jax_steps --json out.json
    timeout 120 mpiexec -n 2 python -m benchmarks.jax_steps --quick
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mpi4py import MPI  # noqa: E402

import commlib  # noqa: E402
from benchmarks import _common as bc  # noqa: E402
from commlib.bindings.jax import (  # noqa: E402
    DistributedOptimizer,
    average_gradients,
    clip_by_global_norm,
    sharded_optimizer,
)
from commlib.collectives import AllReduce, DeAR, SelSync, SyncSwitch  # noqa: E402
from commlib.collectives.policies import SchedulePolicy  # noqa: E402

CONTENDERS = ("local", "average", "raw", "dopt-allreduce", "selsync-bsp", "selsync-local", "syncswitch-asp",
              "sharded", "sharded-clip", "local-jit", "average-jit", "selsync-bsp-jit", "selsync-local-jit",
              "syncswitch-asp-jit", "sharded-jit", "sharded-clip-jit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bc.base_parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=bc.positive_int, default=1024,
                   help="hidden width (1024: about 1.9M parameters)")
    p.add_argument("--batch", type=bc.positive_int, default=32,
                   help="samples per rank (32)")
    p.add_argument("--rounds", type=bc.positive_int, default=5,
                   help="alternating rounds per contender (5)")
    p.add_argument("--steps", type=bc.positive_int, default=10,
                   help="training steps per round (10)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    return bc.parse_quick(p, argv, rounds=2, steps=3, hidden=64)   # given options win over --quick


def init_params(hidden: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {"l1": {"w": jax.random.normal(k[0], (784, hidden)) * 0.03, "b": jnp.zeros(hidden)},
            "l2": {"w": jax.random.normal(k[1], (hidden, hidden)) * 0.03, "b": jnp.zeros(hidden)},
            "out": {"w": jax.random.normal(k[2], (hidden, 10)) * 0.03, "b": jnp.zeros(10)}}


def loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["l1"]["w"] + params["l1"]["b"])
    h = jax.nn.relu(h @ params["l2"]["w"] + params["l2"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_tx(name: str, comm: commlib.Communicator, inner: Any) -> Any:
    """The optax transformation of contender ``name`` (``average``, ``sharded[-clip]`` or a
    ``DistributedOptimizer``'s)."""
    if name == "average":
        return optax.chain(average_gradients(comm=comm, strategy=AllReduce()), inner)
    if name == "sharded":
        return sharded_optimizer(inner, comm=comm, strategy=DeAR())
    if name == "sharded-clip":
        return sharded_optimizer(optax.chain(clip_by_global_norm(1.0), inner), comm=comm, strategy=DeAR())
    strategy = {"dopt-allreduce": lambda: AllReduce(),
                "selsync-bsp": lambda: SelSync(delta=0.0, mode="grads"),
                "selsync-local": lambda: SelSync(delta=math.inf, warmup=0),
                "syncswitch-asp": lambda: SyncSwitch(policy=SchedulePolicy("asp"))}[name]()
    return DistributedOptimizer(inner, strategy=strategy, comm=comm)


def make_step(name: str, comm: commlib.Communicator, params: dict,
              grad_fn: Callable) -> tuple[Callable[[Any], Any], Any]:
    """A function ``carry -> carry`` (carry: ``(params, state, x, y)``) taking one training step, and the
    optimizer state it starts from."""
    inner = optax.sgd(0.01, momentum=0.9)
    apply = jax.jit(optax.apply_updates)
    if name.endswith("-jit"):
        tx = inner if name == "local-jit" else make_tx(name[:-len("-jit")], comm, inner)

        @jax.jit
        def whole(p: Any, s: Any, x: Any, y: Any) -> Any:
            u, s = tx.update(grad_fn(p, x, y), s, p)
            return optax.apply_updates(p, u), s

        def jitted(carry: Any) -> Any:
            p, s, x, y = carry
            p, s = whole(p, s, x, y)
            return jax.block_until_ready(p), s, x, y
        return jitted, tx.init(params)
    if name in ("local", "raw"):
        update = jax.jit(inner.update)
        mc = comm.mpi_comm

        def local(carry: Any) -> Any:
            p, s, x, y = carry
            g = grad_fn(p, x, y)
            if name == "raw":
                leaves, treedef = jax.tree_util.tree_flatten(g)
                flat = np.concatenate([np.asarray(v).reshape(-1) for v in leaves])
                mc.Allreduce(MPI.IN_PLACE, flat)
                flat /= comm.size
                offsets = np.cumsum([0] + [v.size for v in leaves])
                g = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[a:b].reshape(v.shape)) for a, b, v
                                                           in zip(offsets[:-1], offsets[1:], leaves)])
            u, s = update(g, s, p)
            return jax.block_until_ready(apply(p, u)), s, x, y      # the others' steps end on the host
        return local, inner.init(params)
    tx = make_tx(name, comm, inner)

    def step(carry: Any) -> Any:
        p, s, x, y = carry
        u, s = tx.update(grad_fn(p, x, y), s, p)
        return apply(p, u), s, x, y
    return step, tx.init(params)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    comm = commlib.init()
    mc = comm.mpi_comm
    params = init_params(args.hidden)
    numel = sum(x.size for x in jax.tree_util.tree_leaves(params))
    rng = np.random.default_rng(comm.rank)
    x = jnp.asarray(rng.standard_normal((args.batch, 784)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, args.batch).astype(np.int32))
    grad_fn = jax.jit(jax.grad(loss))
    steps, carries = {}, {}
    for name in args.contenders:
        steps[name], state = make_step(name, comm, params, grad_fn)
        carries[name] = (params, state, x, y)
        for _ in range(2):          # compile, warm the buffers
            carries[name] = steps[name](carries[name])

    def run(name: str) -> None:
        carries[name] = steps[name](carries[name])

    times: dict[str, list[float]] = {k: [] for k in args.contenders}
    for _ in range(args.rounds):
        for name in args.contenders:
            times[name].append(bc.timed(mc, lambda n=name: run(n), args.steps))
    med = {k: bc.median(v) for k, v in times.items()}
    doc = {"benchmark": "jax_steps", "ranks": comm.size, "args": vars(args), "parameters": int(numel),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "environment": bc.environment(mc), "step_s": med, "rounds": times,
           "over_average": over(med, "average"), "over_local": over(med, "local")}
    return bc.publish(args, doc, report)


def over(med: dict[str, float], base: str) -> dict[str, float]:
    """Each contender's step over ``base``'s (a jitted one's over ``base-jit``'s)."""
    out = {}
    for k, v in med.items():
        b = base + "-jit" if k.endswith("-jit") else base
        if b in med:
            out[k] = v / med[b]
    return out


def report(doc: dict[str, Any]) -> str:
    rows = [[k, v * 1e3, doc["over_average"].get(k, "-"), doc["over_local"].get(k, "-")]
            for k, v in doc["step_s"].items()]
    a = doc["args"]
    return "\n".join([
        f"JAX training steps, {doc['ranks']} ranks ({doc['date']}): MLP of {doc['parameters']} float32 "
        f"parameters, batch {a['batch']} per rank, SGD momentum; median of {a['rounds']} rounds of "
        f"{a['steps']} steps (slowest rank)",
        bc.markdown_table(["contender", "step ms", "/ average", "/ local"], rows),
        "(a jitted contender's ratios: over average-jit and local-jit)",
    ])


if __name__ == "__main__":
    main()

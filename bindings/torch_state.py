"""The optimizer state of :class:`bindings.torch.DistributedOptimizer`, whole whatever the sharding.

:class:`ConsolidatedState` is the part of ``DistributedOptimizer`` that gathers
the optimizer state a sharded strategy (``DeAR``) keeps in 1/size pieces into
the wrapped optimizer's own per-parameter format, and spreads it back: for
``state_dict()`` / ``load_state_dict()`` (a checkpoint loadable on any number of
ranks, or by a plain optimizer) and for re-planning the buckets; that builds
the optimizer over this rank's shards (:func:`shard_problem` says whether its
class can run on them); that runs the update between the wrapped optimizer's own
step hooks; that keeps ``opt.state`` the wrapped optimizer's, where a reset made as
in one process reaches the shards (:class:`ShardedParamState`); and that
averages it over ranks where a strategy asks (SelSync's synchronized steps,
Sync-Switch on its way back to BSP: :mod:`bindings.torch_phases`).

Example:
    >>> sd = opt.state_dict()            # a collective under DeAR: every rank
    >>> torch.optim.AdamW(model.parameters()).load_state_dict(
    ...     {k: v for k, v in sd.items() if k != "commlib"})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .torch_amp import LossScale
from .torch_comm import Layout, dtype_name, flat_in_layout, in_layout
from .torch_unused import UnusedParameters

__all__ = ["ConsolidatedState", "ShardedParamState", "shard_problem"]

_SHARDED = ("a sharded strategy (DeAR) keeps the optimizer state in pieces, 1/size of it on each rank "
            "(ZeRO-1), so opt.state[p] holds none of it: opt.state_dict() gives it whole (a collective: "
            "call it on every rank); clearing or assigning opt.state or opt.state[p] resets it, as in one "
            "process")


#: state torch's optimizers keep one of per parameter whatever its shape (a step count, NAdam's
#: product, ASGD's rates), as torch's ``load_state_dict`` tells ``"step"`` from the rest by its key
_PER_PARAMETER = frozenset({"step", "mu_product", "eta", "mu"})


def _per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether state ``value`` holds one value per element of ``param`` (a momentum buffer): a
    tensor of some dimension, or, for a 0-dim parameter (where both kinds are 0-dim), one under a
    key other than :data:`_PER_PARAMETER`'s."""
    return torch.is_tensor(value) and (value.dim() > 0 or (param.dim() == 0 and key not in _PER_PARAMETER))


def _unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer class's ``step`` without the wrapper torch's ``Optimizer`` puts around it (the
    global and the instance's step hooks), for a caller that runs the hooks it wants itself."""
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


class ShardedParamState(dict):
    """A trained parameter's entry in ``opt.state`` under a sharded strategy (DeAR): empty, for its
    state lives in pieces on the ranks (ZeRO-1).  Reading a key raises ``KeyError`` saying so.  What
    code does to the entries as it would to one process's (``opt.state.clear()``, ``opt.state =
    defaultdict(dict)``, ``del opt.state[p]``, ``opt.state[p] = {}``, or a dict of whole tensors)
    becomes the pieces' state at the next ``step()``, ``state_dict()`` or re-plan.

    Example:
        >>> opt.state.clear()            # Adam starts again from zero moments, on every shard
    """

    def __missing__(self, key: Any) -> Any:
        raise KeyError(f"{key!r}: {_SHARDED}")


def _as_torch(obj: Any) -> Any:
    """A strategy's state (numpy arrays and scalars inside dicts and lists) as ``torch.load``'s
    default ``weights_only=True`` reads it back: arrays as tensors, numpy scalars as Python's."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _as_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_torch(v) for v in obj)
    return obj


def _as_numpy(obj: Any) -> Any:
    """The inverse of :func:`_as_torch`: tensors back to the numpy arrays the strategy saved."""
    if torch.is_tensor(obj):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _as_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_numpy(v) for v in obj)
    return obj


def shard_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s class cannot run on shards, or ``None``: a sharded strategy runs one
    optimizer per rank over the rank's flat pieces of the buckets, which updates as the whole
    does only where the update of an element depends on that element alone (SGD, Adam, AdamW,
    RMSprop...: not LAMB's or LARS's per-tensor trust ratio, Adafactor's factored moments, Muon's
    orthogonalized matrices, LBFGS's line search).  Tried, not looked up, so that any class is
    judged (yours, timm's): one 4x6 parameter under one optimizer against its flattened halves
    under one each, six steps of a quadratic in float64 with the first group's settings (an
    optimizer that departs from elementwise only on other problems, AdamP's projection, passes;
    one that cannot run here on its own, a Hessian-based one, is left to its own errors; one that
    cannot be made from parameter groups, a wrapper of another optimizer, is refused).

    Example:
        >>> shard_problem(torch.optim.AdamW(model.parameters()))      # None: elementwise
    """
    cls = type(optimizer)
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    device = first.device if first is not None else torch.device("cpu")
    settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    gen = torch.Generator().manual_seed(1234)
    w0, a, b = (torch.rand(4, 6, generator=gen, dtype=torch.float64) + (0.5 if i == 1 else -0.5)
                for i in range(3))

    def train(pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        runs = []
        for w, aw, bw in pieces:
            p = torch.nn.Parameter(w.clone().to(device))
            aw, bw = aw.to(device), bw.to(device)

            def closure(p=p, aw=aw, bw=bw) -> torch.Tensor:     # noqa: ANN001 - one per piece
                p.grad = None
                with torch.enable_grad():
                    loss = (0.5 * aw * p * p + bw * p).sum()
                    loss.backward()
                return loss
            runs.append((p, cls([{"params": [p], **settings}]), closure))     # as the shard optimizer
        for _ in range(6):
            for _, opt, closure in runs:
                opt.step(closure)
        return torch.cat([p.detach().reshape(-1).cpu() for p, _, _ in runs])

    try:
        cls([{"params": [torch.nn.Parameter(w0.clone().to(device))], **settings}])
    except Exception as e:  # noqa: BLE001 - timm's Lookahead: cls(base_optimizer)
        return (f"{cls.__name__} cannot be made from parameter groups, as the shard optimizer is made "
                f"({type(e).__name__}: {e}); an optimizer that wraps another (Lookahead) goes around "
                f"DistributedOptimizer: {cls.__name__}(DistributedOptimizer(inner, model, ...))")
    try:
        whole = train([(w0, a, b)])
    except Exception:       # noqa: BLE001 - not runnable here: its own error comes when it runs
        return None
    halves = [tuple(t.reshape(-1)[k * 12:(k + 1) * 12] for t in (w0, a, b)) for k in range(2)]
    try:
        split = train(halves)
    except Exception as e:  # noqa: BLE001 - Muon: "only supports 2D parameters"
        return f"{cls.__name__} is not elementwise (on a flat piece of a parameter: {e})"
    moved, off = whole - w0.reshape(-1), (split - whole).abs().max().item()
    if off > 1e-9 * moved.abs().max().item():      # elementwise: the same bits, up to rounding
        return (f"{cls.__name__} is not elementwise (its update of an element depends on others: on the two "
                f"flat halves of a parameter, each under an optimizer of its own as on two ranks' shards, it "
                f"differed from its update of the whole by {off / moved.abs().max().item():.2g} of its size)")
    return None


class ConsolidatedState:
    """Mixin of :class:`bindings.torch.DistributedOptimizer` (uses its buckets, pieces and strategy)."""

    comm: Any
    strategy: Any
    buckets: list[Any]
    param_groups: list[dict[str, Any]]
    _inner: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]
    _group_of: list[int]
    _frozen: list[torch.nn.Parameter]
    #: each parameter's bucket (-1: none, a parameter of no element) and ``.grad`` view
    _bucket_of: list[int]
    _grad_views: list[torch.Tensor]
    _layouts: list[Layout]
    _flat_params: list[torch.Tensor]
    _flat_grads: list[torch.Tensor]
    _pieces: list[tuple[torch.Tensor, int, slice, int, slice]]
    _shard_opt: torch.optim.Optimizer
    _planned_cap: int
    _wrapped: bool
    _state_marks: list[ShardedParamState]
    _unused: UnusedParameters
    _loss_scale: LossScale
    #: whether the update runs on shards (the strategy's ``sharded`` when the update's side was made)
    _sharded: bool | None
    #: under a sharded strategy, the state dict loaded since the last step: this rank keeps only its
    #: pieces, so that a broadcast from it (Horovod's resume: rank 0 alone reads the checkpoint) sends it
    _loaded: dict[str, Any] | None = None
    #: a load whose strategy part is a collective (``Strategy.load_is_collective``: Sync-Switch
    #: re-entering a checkpoint's phase), as (optimizer state dict, strategy state): taken on every
    #: rank together, at ``broadcast_optimizer_state`` or the next training forward
    _pending_load: tuple[dict[str, Any], dict[str, Any]] | None = None

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state, ``opt.state[p]``: one object with the wrapped
        optimizer's, so that assigning another (``opt.state = defaultdict(dict)``, Adam's reset)
        replaces the state the update reads.  Under a sharded strategy each entry is a
        :class:`ShardedParamState`.

        Example:
            >>> opt.state = collections.defaultdict(dict)    # start the moments again
        """
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        if self._wrapped:       # torch's Optimizer.__init__ sets an empty one first: the wrapped one's stays
            self._inner.state = value

    def _build_shard_optimizer(self) -> None:
        """One optimizer of the user's class over this rank's pieces of every bucket."""
        rank = self.comm.rank
        groups: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        # (piece, param index, slice of the flat parameter, bucket index, slice of the bucket)
        self._pieces = []
        for b in self.buckets:
            for idx, pslice, bslice in b.pieces(rank):
                piece = torch.nn.Parameter(self._flat_params[b.index][bslice], requires_grad=True)
                piece.grad = self._flat_grads[b.index][bslice]     # the reduced shard lands here
                groups[self._group_of[idx]].append(piece)
                self._pieces.append((piece, idx, pslice, b.index, bslice))
        for idx, b in enumerate(self._bucket_of):
            if b < 0:       # of no element: an empty piece on every rank (its state: Adam's step)
                piece = torch.nn.Parameter(self._params[idx].detach().reshape(-1), requires_grad=True)
                piece.grad = self._grad_views[idx].reshape(-1)
                groups[self._group_of[idx]].append(piece)
                self._pieces.append((piece, idx, slice(0, 0), -1, slice(0, 0)))
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self._shard_opt = type(self._inner)([{"params": ps, **h} for ps, h in zip(groups, hyper)])
        # state the wrapped optimizer holds already is its pieces': a checkpoint loaded before
        # wrapping, Adagrad's accumulators made by its constructor (from its own arguments, which
        # the shard optimizer made from the groups does not see)
        whole = self._whole_states()
        held = {i: dict(whole[p]) for i, p in enumerate(self._params) if whole.get(p)}
        if held:
            self._load_pieces(held)
        self._mark_sharded_state()

    def _whole_states(self) -> dict[Any, Any]:
        """The entries of ``opt.state`` the wrapped optimizer holds whole (every one under an
        unsharded strategy; under a sharded one, those of parameters it does not train and any
        loaded or assigned since they were marked), not a sharded strategy's empty marks."""
        return {p: d for p, d in self._inner.state.items() if not isinstance(d, ShardedParamState)}

    def _mark_sharded_state(self) -> None:
        """Each trained parameter's entry in ``opt.state`` a fresh :class:`ShardedParamState` (and no
        entry left for a parameter that stopped training)."""
        self._drop_sharded_marks()
        st = self._inner.state
        self._state_marks = [ShardedParamState() for _ in self._params]
        for p, mark in zip(self._params, self._state_marks):
            st[p] = mark

    def _drop_sharded_marks(self) -> None:
        """No :class:`ShardedParamState` left in ``opt.state`` (the state whole, or marked afresh)."""
        st = self._inner.state
        for p in [p for p, v in st.items() if isinstance(v, ShardedParamState)]:
            del st[p]

    def _adopt_state_edits(self) -> None:
        """Sharded strategies: entries of ``opt.state`` that code cleared, deleted or replaced since
        they were marked (a reset; a dict of whole tensors: that state) become the state of this
        rank's pieces of those parameters (no communication: every rank edits alike, as the code
        that edits runs on every rank)."""
        st = self._inner.state
        edits = {i: dict(st.get(p) or {}) for i, (p, mark) in enumerate(zip(self._params, self._state_marks))
                 if st.get(p) is not mark or mark}
        if edits:
            self._load_pieces(edits)
            self._mark_sharded_state()

    def _full_state(self) -> dict[int, dict[str, Any]]:
        """Per parameter (index in ``self._params``): its optimizer state, gathered from the shards
        (a collective for sharded strategies: identical calls on every rank)."""
        if not self._sharded:
            return {i: self._inner.state[p] for i, p in enumerate(self._params) if p in self._inner.state}
        self._adopt_state_edits()
        keys: dict[int, list[str]] = {}     # per parameter: its tensors' keys (per group: amsgrad's)
        scalars: dict[int, dict[str, Any]] = {}
        for piece, idx, *_ in self._pieces:
            st = self._shard_opt.state.get(piece)
            if st is None:
                continue
            d = scalars.setdefault(idx, {})
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    keys.setdefault(idx, []).append(k)
                elif torch.is_tensor(v):
                    d[k] = ("tensor", v.item(), dtype_name(v))
                else:
                    d[k] = ("value", v, None)
        gathered = self.comm.allgather_object((keys, scalars), label="DistributedOptimizer.state_dict()")
        keys_of: dict[int, set[str]] = {}
        out: dict[int, dict[str, Any]] = {}
        for part_keys, part in gathered:
            for i, ks in part_keys.items():
                keys_of.setdefault(i, set()).update(ks)
            for i, d in part.items():
                st = out.setdefault(i, {})
                for k, (kind, v, dt) in d.items():
                    st[k] = torch.tensor(v, dtype=getattr(torch, dt)) if kind == "tensor" else v
        rank = self.comm.rank
        for key in sorted(set().union(*keys_of.values())):
            for b in self.buckets:
                has = [sl for sl in b.slots if key in keys_of.get(sl.index, ())]
                if not has:         # known alike on every rank: no all-gather of nothing
                    continue
                fp = self._flat_params[b.index]
                flat = torch.zeros(b.padded, dtype=fp.dtype, device=fp.device)
                for piece, _, _, bi, bslice in self._pieces:
                    v = self._shard_opt.state.get(piece, {}).get(key) if bi == b.index else None
                    if v is not None:
                        flat[bslice] = v
                base = b.shard(rank).start
                self.comm.allgather(flat[base:base + b.shard_numel], out=flat, tag="state")
                for sl in has:
                    out[sl.index][key] = in_layout(flat, sl.offset, self._layouts[sl.index]).clone()
        for piece, idx, _, bi, _ in self._pieces:
            if bi < 0:      # of no element: every rank holds it whole
                for k, v in self._shard_opt.state.get(piece, {}).items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        out[idx][k] = v.reshape(self._params[idx].shape).clone()
        return out

    def _states_by_param(self) -> dict[int, dict[str, Any]]:
        """By ``id`` of parameter, before a re-plan: the state of every parameter that has one,
        trained (gathered from the shards: a collective under a sharded strategy) or not (held
        whole by the wrapped optimizer, as in one process: frozen after training, or loaded)."""
        full = self._full_state()
        out = {id(p): d for p, d in self._whole_states().items()}
        out.update({id(self._params[i]): d for i, d in full.items()})
        return out

    def _restore_states(self, kept: dict[int, dict[str, Any]], before: list[torch.Tensor]) -> None:
        """After a re-plan: each trained parameter's state from ``kept`` (in pieces under a sharded
        strategy); one that stopped training keeps its state whole, as in one process (unfrozen
        again, it trains on from it)."""
        self._set_full_state({i: kept[id(p)] for i, p in enumerate(self._params) if id(p) in kept})
        if self._sharded:
            now = {id(p) for p in self._params}
            for p in before:
                if id(p) not in now and id(p) in kept:
                    self._inner.state[p] = kept[id(p)]

    def _set_full_state(self, full: dict[int, dict[str, Any]]) -> None:
        if not self._sharded:
            for i, d in full.items():      # state follows its parameter's device and dtype, as in
                p = self._params[i]        # torch's Optimizer.load_state_dict (a moved model)
                self._inner.state[p] = {
                    k: (v.to(p.device, p.dtype if v.is_floating_point() else None)
                        if _per_element(k, v, p) else v)
                    for k, v in d.items()}
            return
        self._shard_opt.state.clear()
        self._load_pieces(full)
        self._mark_sharded_state()

    def _load_pieces(self, full: dict[int, dict[str, Any]]) -> None:
        """The state of this rank's pieces of the parameters in ``full`` (index: whole state; an
        empty dict: none, as a fresh optimizer's)."""
        for piece, idx, pslice, *_ in self._pieces:
            d = full.get(idx)
            if d is None:
                continue
            if not d:
                self._shard_opt.state.pop(piece, None)
                continue
            param = self._params[idx]
            self._shard_opt.state[piece] = {
                k: (flat_in_layout(v.to(piece.device, piece.dtype), self._layouts[idx])[pslice].clone()
                    if _per_element(k, v, param)
                    else v.clone() if torch.is_tensor(v) else v)
                for k, v in d.items()}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated optimizer state (``optimizer``'s format) plus the strategy's.

        A collective for sharded strategies: call it on every rank.
        """
        self._end_skipped_step(zero=False)      # a step the grad_scaler skipped, in the state saved
        self._complete()
        full = self._full_state()
        saved, whole = dict(self._inner.state), self._whole_states()
        try:
            self._inner.state.clear()       # the state of parameters it does not train stays too
            self._inner.state.update(whole)
            for i, d in full.items():
                self._inner.state[self._params[i]] = d
            sd = self._inner.state_dict()
        finally:
            self._inner.state.clear()
            self._inner.state.update(saved)
        strategy = self._pending_load[1] if self._pending_load is not None else self.strategy.state_dict()
        sd["commlib"] = {"strategy": _as_torch(strategy), "world_size": self.comm.size,
                         "loss_scale": self._loss_scale.seen, "agree_scales": self._loss_scale.due}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (from any number of ranks, or a plain optimizer's).

        A strategy state whose load is a collective (a Sync-Switch checkpoint taken in ASP or SSP,
        or any loaded while asynchronous: its phase is re-entered) takes effect on every rank together
        at the next training forward, or at once in ``broadcast_optimizer_state`` (rank 0 may load
        alone, as in Horovod's resume); ``state_dict()`` gives the loaded state until then.
        """
        sd = dict(state_dict)
        extra = sd.pop("commlib", None)
        strategy = None if extra is None else _as_numpy(extra["strategy"])
        if strategy is not None:        # refused before anything changes, as torch refuses a load
            self.strategy.check_state(strategy)
        if self._sharded:
            self._check_piece_sizes(sd)
        self._inner.load_state_dict(sd)
        self._pending_load = None
        self._loaded = state_dict if self._sharded else None
        self._optimizer_loaded()        # noted for the next step's agreement (ReplicaLoads)
        self.param_groups = self._inner.param_groups     # torch replaced the group list
        if self._sharded:       # the trained parameters' state to their pieces; the rest's stays
            full = {i: self._inner.state[p] for i, p in enumerate(self._params) if p in self._inner.state}
            for p in self._params:
                self._inner.state.pop(p, None)
            self._set_full_state(full)
        if extra is None:
            return
        # the units the strategy's state is in, and whether the ranks' scalers are still to agree
        self._loss_scale.resume(extra.get("loss_scale"), extra.get("agree_scales", False))
        if self.strategy.load_is_collective(strategy):
            self._pending_load = (sd, strategy)
        else:       # a tuned cap re-plans at the next training forward, on every rank (rank 0 may load alone)
            self._load_strategy(sd, strategy)

    def _check_piece_sizes(self, sd: dict[str, Any]) -> None:
        """A sharded strategy cuts each trained parameter's state into pieces: a state tensor of
        another size than its parameter (another model's checkpoint) is refused naming it, before
        the load changes anything (torch's own load takes it; its step would fail later)."""
        saved = sd.get("state", {})
        ids = [i for g in sd.get("param_groups", []) for i in g.get("params", [])]
        ours = [p for g in self._inner.param_groups for p in g["params"]]
        trained = {id(p) for p in self._params}
        for key, p in zip(ids, ours):
            for k, v in (saved.get(key) or {}).items():
                if id(p) in trained and torch.is_tensor(v) and v.dim() > 0 and v.numel() != p.numel():
                    raise ValueError(f"load_state_dict: state {k!r} of parameter #{key} has shape "
                                     f"{tuple(v.shape)} but the parameter {tuple(p.shape)} (a checkpoint of "
                                     "another model?)")

    def _load_strategy(self, sd: dict[str, Any], strategy: dict[str, Any]) -> None:
        """The strategy's part of a load; a phase switch it makes (Sync-Switch) moves the state with it."""
        was_sharded = self._sharded
        self.strategy.load_state_dict(strategy)
        if was_sharded and not self._sharded:   # whole again: this rank's own state as loaded, not
            self._inner.load_state_dict(sd)     # the gather of every rank's piece of its own file
            self.param_groups = self._inner.param_groups

    def _take_pending_load(self) -> None:
        """The collective part of the last load, on every rank together (they have all loaded)."""
        if self._pending_load is not None:
            sd, strategy = self._pending_load
            self._pending_load = None
            self._load_strategy(sd, strategy)

    def broadcast_state(self, root_rank: int = 0) -> None:
        """Every rank's optimizer state and hyperparameters become ``root_rank``'s (a collective:
        every rank calls it); :func:`broadcast_optimizer_state` calls it.  Under a sharded strategy
        a state dict ``root_rank`` loaded since its last step is sent whole (its own pieces are all
        it keeps of it): Horovod's resume, where rank 0 alone loads the checkpoint, then broadcasts.
        A Sync-Switch checkpoint's phase is re-entered here, on every rank together.

        Example:
            >>> if comm.rank == 0:
            ...     opt.load_state_dict(torch.load(path)["opt"])
            >>> opt.broadcast_state(0)
        """
        comm = self.comm
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < comm.size:
            raise ValueError(f"broadcast_optimizer_state: root_rank {root_rank!r} is not a rank of "
                             f"0..{comm.size - 1}")
        label = "broadcast_optimizer_state()"
        root_rank = int(root_rank)
        sd = comm.allgather_object(self._loaded if comm.rank == root_rank else None, label=label)[root_rank]
        if sd is None:
            sd = self.state_dict()
            sd = comm.allgather_object(sd if comm.rank == root_rank else None, label=label)[root_rank]
        self.load_state_dict(sd)
        self._take_pending_load()       # every rank is here

    # ------------------------------------------------------------------ the update
    def _pre_step_hooks(self, evaluate: Callable[[], Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The step pre-hooks registered on the wrapped optimizer (before wrapping: a logger, an EMA),
        run as its own ``step()`` runs them; returns the step's arguments as they leave them.  With
        :meth:`_inner_step` and :meth:`_post_step_hooks`, the wrapped optimizer's step as it runs in one
        process, while torch's global optimizer hooks are left to the wrapper's ``step()`` (once)."""
        inner = self._inner
        args: tuple[Any, ...] = (inner,) if evaluate is None else (inner, evaluate)
        kwargs: dict[str, Any] = {}
        for hook in list(inner._optimizer_step_pre_hooks.values()):
            result = hook(inner, args, kwargs)
            if result is not None:
                if self._sharded:
                    raise RuntimeError(f"DistributedOptimizer: a step pre-hook of {type(inner).__name__} "
                                       f"changed step()'s arguments, which {self.strategy.name}'s update on "
                                       "shards does not take")
                args, kwargs = result
        return args, kwargs

    def _inner_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The wrapped optimizer's update (not sharded), without torch's hooks around it."""
        return _unhooked(type(self._inner).step)(*args, **kwargs)

    def _post_step_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The wrapped optimizer's step post-hooks, once the parameters are this step's (DeAR's
        all-gathers started: a hook that reads a parameter waits for it), and the step recorded for
        an LR scheduler made over it (no "lr_scheduler.step() before optimizer.step()" warning)."""
        inner = self._inner
        for hook in list(inner._optimizer_step_post_hooks.values()):
            hook(inner, args, kwargs)
        inner._opt_called = True

    def _update_shards(self) -> None:
        """The shard optimizer's step over this rank's pieces, with the groups' hyperparameters as
        they are now (schedulers change them), the edits made to ``opt.state``, and the pieces of
        parameters no rank gave a gradient left out, as those whose ``.grad`` was set to ``None``
        after ``backward()`` (``p.grad = None``, a sub-module's ``zero_grad()``): one process's
        optimizer skips both."""
        for sg, g in zip(self._shard_opt.param_groups, self.param_groups):
            for k, v in g.items():
                if k != "params":
                    sg[k] = v
        self._adopt_state_edits()
        self._loaded = None
        params = self._params
        for piece, idx, *_ in self._pieces:
            if idx in self._unused.indices or params[idx].grad is None:
                piece.grad = None
        _unhooked(type(self._shard_opt).step)(self._shard_opt)
        for piece, idx, _, bi, bslice in self._pieces:
            piece.grad = self._flat_grads[bi][bslice] if bi >= 0 else self._grad_views[idx].reshape(-1)
        self._update_frozen()

    def _update_frozen(self) -> None:
        """Sharded: the wrapped optimizer's step over the frozen parameters that keep a ``.grad``
        (frozen after ``zero_grad(set_to_none=False)``: one process keeps a zero one and goes on
        moving them by momentum and weight decay); their state stayed whole in it at the re-plan.
        (Not sharded, the wrapped optimizer's own step takes them.)"""
        live = {id(p) for p in self._frozen if p.grad is not None}
        if not live:
            return
        groups = self._inner.param_groups
        every = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in live]
            _unhooked(type(self._inner).step)(self._inner)
        finally:
            for g, ps in zip(groups, every):
                g["params"] = ps

"""RayWorkerGroup: PolicyWorker as Ray actors (placement, torch.distributed, sharded calls).

Ray is the engine: a placement group places the N actors (one bundle each), Ray's object store
carries arguments and results, `ray.wait` bounds every wait. The group adds only what Ray does
not know: it hands every actor the torch.distributed environment (MASTER_ADDR / MASTER_PORT of
rank 0's node, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) so the workers build their
(dp, cp, tp) mesh exactly as under torchrun; it splits data over the data-parallel ranks with
`BatchedDataDict.shard_by_batch_size` and puts the results back in the caller's row order.

Failure: a rank that raises, dies or overruns `timeout_s` fails the group call with a
`WorkerGroupError` naming the rank and the method. A death or an overrun leaves the peers stuck
in a collective, so the group refuses further calls (call `shutdown()`, start a new group);
`shutdown()` kills every actor and removes the placement group the group created.

Colocation: pass your own `placement_group` (and `bundle_indices`) to share bundles with your
inference actors; `group.bundle_indices[r]` is rank r's bundle, `group.refit_node_id` the node
a ZMQ refit receiver must run on (ipc:// sockets and shared memory are node-local).

Bad input: every dp rank's shard passes the worker's own batch checks on the driver before any
rank starts (`shard_checks`), so a bad row refuses the call by its dp rank and rows and the group
stays usable; the workers' own checks agree across ranks too (`shell.parallel.agreed_checks`).

Ray narrows CUDA_VISIBLE_DEVICES to an actor's GPU, so a GPU worker's device is cuda:0.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from policyworker.errors import WorkerGroupError, WorkerGroupTimeoutError
from policyworker.functional.worker_group import dp_leader_ranks, local_ranks
from policyworker.shell.ray.actor import (
    PlacementStrategy,
    PolicyWorkerActor,
    WorkerGroupOptions,
    import_ray,
    make_placement_group,
)
from policyworker.shell.ray.calls import RankResults
from policyworker.shell.ray.shard_checks import check_shards
from policyworker.shell.ray.sharding import split_over_dp

if TYPE_CHECKING:
    from policyworker.config import PolicyConfig

__all__ = ["RayWorkerGroup"]

_WORKER_KWARGS = ("weights_path", "optimizer_path", "init_optimizer", "init_reference_model")
_SHUTDOWN_WAIT_S = 10.0


class RayWorkerGroup:
    """N PolicyWorker actors forming one (dp, cp, tp) mesh; the worker's methods on the group.

    Data methods (`train`, `get_logprobs`, ...) split `data` over the dp ranks and return one
    result in the caller's row order; lifecycle and checkpoint methods run on every rank; refit
    methods return rank 0's answer (the rank that streams); `run` calls any worker method on
    every rank and returns the per-rank results.
    """

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        *,
        num_workers: int,
        strategy: str = "PACK",
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float | None = None,
        torch_threads: int | None = None,
        timeout_s: float = 600.0,
        collective_timeout_s: float = 600.0,
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
        worker_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        started = time.perf_counter()
        ray = self._ray = import_ray()
        from policyworker.config import load_config, validate_for_world

        self.options = WorkerGroupOptions(
            num_workers=num_workers,
            # A plain str from callers: the options' in_(STRATEGIES) validator checks it.
            strategy=cast("PlacementStrategy", strategy),
            cpus_per_worker=cpus_per_worker,
            gpus_per_worker=gpus_per_worker,
            torch_threads=torch_threads,
            timeout_s=timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
        self.cfg = load_config(config) if isinstance(config, Mapping) else config
        dcfg = self.cfg.dtensor_cfg
        self.tp_size, self.cp_size = dcfg.tensor_parallel_size, dcfg.context_parallel_size
        self._leaders = dp_leader_ranks(
            world_size=num_workers, cp_size=self.cp_size, tp_size=self.tp_size
        )
        self.world_size, self.dp_size = num_workers, len(self._leaders)
        validate_for_world(self.cfg, dp_size=self.dp_size)
        unknown = sorted(set(worker_kwargs or {}) - set(_WORKER_KWARGS))
        if unknown:
            msg = (
                f"worker_kwargs {unknown} are not PolicyWorker options; use {list(_WORKER_KWARGS)}"
            )
            raise ValueError(msg)
        if not ray.is_initialized():
            ray.init()  # no cluster yet: start a local one, as Ray itself would on first use
        gpus = self._gpus_per_worker()
        self._actors: list[Any] = []
        self._results = RankResults(ray, timeout_s=timeout_s)
        self._owns_placement_group = placement_group is None
        bundle = {"CPU": cpus_per_worker} | ({"GPU": gpus} if gpus else {})
        self.start_phases: dict[str, float] = {}  # seconds: placement_group, actors, workers
        if placement_group is None:
            placement_group = make_placement_group(
                num_workers, bundle, strategy=strategy, timeout_s=timeout_s
            )
        self.placement_group: Any = placement_group  # a Ray PlacementGroup; None once removed
        self.bundle_indices = tuple(
            range(num_workers) if bundle_indices is None else bundle_indices
        )
        try:
            self._check_bundles()
            self.start_phases["placement_group"] = time.perf_counter() - started
            self._start(config, dict(worker_kwargs or {}), gpus)
        except BaseException:
            self.shutdown()
            raise
        self.start_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------------------ start

    def _gpus_per_worker(self) -> float:
        opts = self.options
        if opts.gpus_per_worker is not None:
            return opts.gpus_per_worker
        cluster_gpus = self._ray.cluster_resources().get("GPU", 0)
        if 0 < cluster_gpus < opts.num_workers:
            msg = (
                f"gpus_per_worker=None (auto) found {cluster_gpus:g} GPU(s) in the cluster for "
                f"num_workers={opts.num_workers}; pass gpus_per_worker (0 runs on CPU) or "
                f"at most {int(cluster_gpus)} workers"
            )
            raise ValueError(msg)
        return 1.0 if cluster_gpus else 0.0

    def _check_bundles(self) -> None:
        count = self.placement_group.bundle_count
        if len(self.bundle_indices) != self.world_size or not all(
            0 <= i < count for i in self.bundle_indices
        ):
            msg = (
                f"bundle_indices={list(self.bundle_indices)} must name {self.world_size} "
                f"bundles of the placement group (indices 0..{count - 1}), one per worker"
            )
            raise ValueError(msg)
        ready, _ = self._ray.wait([self.placement_group.ready()], timeout=self.options.timeout_s)
        if not ready:
            msg = f"the placement group was not ready within {self.options.timeout_s} s"
            raise WorkerGroupTimeoutError(msg, method="placement_group")

    def _start(
        self, config: PolicyConfig | Mapping[str, Any], worker_kwargs: dict[str, Any], gpus: float
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = self.options
        actor_class = self._ray.remote(PolicyWorkerActor)
        threads = opts.torch_threads or max(1, int(opts.cpus_per_worker))
        started = time.perf_counter()
        for index in self.bundle_indices:
            strategy = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            )
            self._actors.append(
                actor_class.options(
                    num_cpus=opts.cpus_per_worker,
                    num_gpus=gpus,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                ).remote(threads)
            )
        where = self._collect("where", [a.where.remote() for a in self._actors])
        self.node_ids = tuple(w["node_id"] for w in where)
        self.master_address = where[0]["ip"]
        self.start_phases["actors"] = time.perf_counter() - started
        port = self._collect("free_port", [self._actors[0].free_port.remote()])[0]
        local = local_ranks(self.node_ids)
        refs = []
        for rank, actor in enumerate(self._actors):
            env = {
                "MASTER_ADDR": self.master_address,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local[rank]),
                "LOCAL_WORLD_SIZE": str(self.node_ids.count(self.node_ids[rank])),
            }
            refs.append(
                actor.start.remote(
                    env,
                    config,
                    worker_kwargs,
                    use_gpu=gpus > 0,
                    collective_timeout_s=opts.collective_timeout_s,
                )
            )
        self.coords = tuple(self._collect("start", refs))
        self.vocab_rows: int = self._collect("vocab_rows", [self._actors[0].vocab_rows.remote()])[0]
        self.start_phases["workers"] = time.perf_counter() - started - self.start_phases["actors"]

    # ------------------------------------------------------------------------------ calls

    def _collect(self, method: str, refs: Sequence[Any]) -> list[Any]:
        """Every ref's value in rank order; the first failure (or the timeout) raises."""
        return self._results.collect(method, refs)

    def _call(
        self, method: str, per_rank: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]]
    ) -> list[Any]:
        if self._results.broken is not None or not self._actors:
            state = self._results.broken or "it was shut down"
            msg = f"cannot call {method}: the group is unusable ({state}); start a new group"
            raise WorkerGroupError(msg, method=method)
        refs = [
            actor.call.remote(method, args, kwargs)
            for actor, (args, kwargs) in zip(self._actors, per_rank, strict=True)
        ]
        return self._collect(method, refs)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`PolicyWorker.<method>(*args, **kwargs)` on every rank; the results in rank order."""
        from policyworker.shell.worker.policy_worker import PolicyWorker

        if method.startswith("_") or not callable(getattr(PolicyWorker, method, None)):
            msg = f"method={method!r} is not a public PolicyWorker method; check the name"
            raise ValueError(msg)
        return self._call(method, [(args, kwargs)] * self.world_size)

    def _sharded(
        self, method: str, data: Mapping[str, Any], *, batch_size: int | None, **kwargs: Any
    ) -> tuple[list[Any], Any]:
        """Run `method(shard, **kwargs)` with each dp rank's shard (checked here first); the dp
        leaders' results and the original row index of every row of the concatenated shards."""
        import torch

        shards, rows = split_over_dp(data, dp_size=self.dp_size, batch_size=batch_size)
        check_shards(
            method,
            shards,
            rows,
            vocab_rows=self.vocab_rows,
            loss_fn=kwargs.get("loss_fn"),
            skip=kwargs.get("check_dim_skip_keys") or (),
        )
        block = self.world_size // self.dp_size
        results = self._call(
            method, [((shards[r // block],), kwargs) for r in range(self.world_size)]
        )
        return [results[r] for r in self._leaders], torch.cat(rows)

    def _in_row_order(self, method: str, data: Mapping[str, Any], **kwargs: Any) -> Any:
        from policyworker.data import BatchedDataDict

        parts, rows = self._sharded(method, data, batch_size=None, **kwargs)
        return BatchedDataDict.from_batches(parts).reorder_data(rows)

    # ------------------------------------------------------------------------------ data

    def train(
        self,
        data: Mapping[str, Any],
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        check_dim_skip_keys: Any = None,
    ) -> dict[str, Any]:
        """One `train` over every global batch: rank 0's result (loss and grad norm are global),
        `all_mb_metrics` holding every dp rank's microbatch metrics (dp order)."""
        gbs = gbs or self.cfg.train_global_batch_size
        parts, _ = self._sharded(
            "train",
            data,
            batch_size=gbs,
            loss_fn=loss_fn,
            eval_mode=eval_mode,
            gbs=gbs,
            mbs=mbs,
            check_dim_skip_keys=check_dim_skip_keys,
        )
        keys = dict.fromkeys(k for part in parts for k in part["all_mb_metrics"])
        metrics = {
            k: [v for part in parts for v in part["all_mb_metrics"].get(k, [])] for k in keys
        }
        return {**parts[0], "all_mb_metrics": metrics}

    def get_logprobs(
        self,
        data: Mapping[str, Any],
        micro_batch_size: int | None = None,
        *,
        entropy: bool = False,
        top_k: int | None = None,
    ) -> Any:
        """`PolicyWorker.get_logprobs` on every dp shard, rows in input order (with `entropy` /
        `top_k`, their keys too)."""
        from policyworker.shell.worker.inference import check_extra_scores

        check_extra_scores(entropy, top_k)  # here, before any rank starts
        return self._in_row_order(
            "get_logprobs", data, micro_batch_size=micro_batch_size, entropy=entropy, top_k=top_k
        )

    def get_reference_policy_logprobs(
        self, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> Any:
        """`PolicyWorker.get_reference_policy_logprobs`, rows split over the dp ranks."""
        return self._in_row_order(
            "get_reference_policy_logprobs", data, micro_batch_size=micro_batch_size
        )

    def get_topk_logits(
        self, data: Mapping[str, Any], k: int, micro_batch_size: int | None = None
    ) -> Any:
        """`PolicyWorker.get_topk_logits`, rows split over the dp ranks, in row order."""
        return self._in_row_order("get_topk_logits", data, k=k, micro_batch_size=micro_batch_size)

    def score(self, data: Mapping[str, Any]) -> Any:
        """`PolicyWorker.score` (reward models), rows split over the dp ranks, in row order."""
        return self._in_row_order("score", data)

    def calibrate_qkv_fp8_scales(self, data: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        """The scales (every rank computes the same from all ranks' samples): rank 0's."""
        return self._sharded("calibrate_qkv_fp8_scales", data, batch_size=None, **kwargs)[0][0]

    # ------------------------------------------------------------------------------ refit

    @property
    def refit_node_id(self) -> str:
        """The Ray node of rank 0, the rank that streams a ZMQ refit: run the receiver there."""
        return self.node_ids[0]

    def prepare_refit_info(self) -> dict[str, Any]:
        """The refit metadata (every rank computes it; rank 0's is returned)."""
        return self.run("prepare_refit_info")[0]

    def get_zmq_address(self) -> str:
        """Rank 0's refit address (ipc://, on `refit_node_id`)."""
        return self.run("get_zmq_address")[0]

    def stream_weights_via_ipc_zmq(
        self,
        buffer_size_bytes: int = 0,
        kv_scales: Any = None,
        *,
        timeout_s: float = 120.0,
        one_pass: bool | None = None,
    ) -> dict[str, Any] | None:
        """One refit: every rank gathers, rank 0 streams; the receiver's report (``one_pass``
        None: one-pass where the receiver registered its memory, else staged)."""
        return self.run(
            "stream_weights_via_ipc_zmq",
            buffer_size_bytes,
            kv_scales,
            timeout_s=timeout_s,
            one_pass=one_pass,
        )[0]

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> None:
        """Join every rank to the collective refit group (see refit-collective.md)."""
        self.run("init_collective", ip, port, world_size, train_world_size=train_world_size)

    def broadcast_weights_for_collective(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One collective refit on every rank; rank 0's report."""
        return self.run("broadcast_weights_for_collective", *args, **kwargs)[0]

    # ------------------------------------------------------------------------------ every rank

    def prepare_for_training(self) -> None:
        """`PolicyWorker.prepare_for_training` on every rank."""
        self.run("prepare_for_training")

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """`PolicyWorker.prepare_for_lp_inference` on every rank."""
        self.run("prepare_for_lp_inference", keep_train_buffers)

    def finish_training(self) -> None:
        """`PolicyWorker.finish_training` on every rank."""
        self.run("finish_training")

    def finish_inference(self) -> None:
        """`PolicyWorker.finish_inference` on every rank."""
        self.run("finish_inference")

    def offload_before_refit(self) -> None:
        """`PolicyWorker.offload_before_refit` on every rank."""
        self.run("offload_before_refit")

    def offload_after_refit(self) -> None:
        """`PolicyWorker.offload_after_refit` on every rank."""
        self.run("offload_after_refit")

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """`PolicyWorker.save_checkpoint` on every rank (each writes its shards)."""
        self.run("save_checkpoint", *args, **kwargs)

    def finalize_async_save(self) -> None:
        """`PolicyWorker.finalize_async_save` on every rank."""
        self.run("finalize_async_save")

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """`PolicyWorker.load_checkpoint` on every rank."""
        self.run("load_checkpoint", *args, **kwargs)

    # ------------------------------------------------------------------------------ shutdown

    @property
    def actors(self) -> tuple[Any, ...]:
        """The actor handles, rank order (empty after shutdown)."""
        return tuple(self._actors)

    def shutdown(self) -> None:
        """Close the workers (briefly), kill every actor, remove the group's placement group."""
        ray, actors = self._ray, self._actors
        self._actors = []
        if actors and self._results.broken is None:  # let healthy workers close sockets and shm
            refs = [a.call.remote("shutdown", (), {}) for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_WAIT_S)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._owns_placement_group and getattr(self, "placement_group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

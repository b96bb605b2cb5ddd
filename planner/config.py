"""Config files: TOML, validated by pydantic, converted once into a ``Job``.

A config has three tables (see configs/ for complete, commented examples):

- ``[cluster]``: nodes, devices per node, per-device memory and compute, intra- and
  inter-node bandwidth and latency, spares, restart and communicator-rebuild costs;
- ``[model]``: either ``[model.gpt]`` (analytic GPT: per-layer parameters, FLOPs and
  activation sizes derived from its shape) or ``[[model.layers]]`` (explicit layers with
  repeat counts), or a ``cost_table`` written by ``chameleon profile`` whose measured
  per-layer times and link figures replace the analytic ones;
- ``[training]``: global and micro batch, precision, optimizer, activation recompute, the
  current layout (dp, pp, tp, rank order), MTBF and checkpoint interval.

Errors become ``ConfigError`` with one line per bad field, naming the field.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.job.costtable import CostTable
from planner.job.errors import ConfigError
from planner.job.failures import DEFAULT_DEVICE_MTBF_H
from planner.job.fsdp import fsdp_layers
from planner.job.workload import Cluster, Job, Layer, Link, Model, RankOrder, Training

GiB = 2**30
FP32_GRAD_BYTES = 4  # TrainingConfig.grad_sum_bytes
Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterConfig(_Strict):
    name: str
    device: Literal["cpu", "cuda", "npu"] = "cuda"
    num_nodes: PositiveInt
    devices_per_node: PositiveInt
    device_memory_gib: Positive
    device_tflops: Positive  # dense peak at the training precision
    mfu: Annotated[float, Field(gt=0, le=1)] = 0.4  # fraction of peak a layer achieves
    memory_bandwidth_gb_per_s: Positive = 1000.0
    intra_node_bandwidth_gb_per_s: Positive  # between two devices of a node
    # A device's links together, when it reaches its peers over several (a mesh); an
    # all-reduce within a node uses all of them, a transfer between two devices one.
    intra_node_aggregate_bandwidth_gb_per_s: Positive | None = None
    intra_node_latency_us: Annotated[float, Field(ge=0)] = 5.0
    inter_node_bandwidth_gb_per_s: Positive
    inter_node_latency_us: Annotated[float, Field(ge=0)] = 10.0
    spare_nodes: Annotated[int, Field(ge=0)] = 0
    restart_s: Annotated[float, Field(ge=0)] = 60.0
    # From a failure to the moment it is seen: chameleon run's agent polls its workers
    # every --monitor-interval (0.1 s). What chameleon simulate charges every failure.
    detection_s: Annotated[float, Field(ge=0)] = 0.1
    pg_init_base_s: Annotated[float, Field(ge=0)] = 0.5
    pg_init_per_worker_s: Annotated[float, Field(ge=0)] = 0.001
    store_round_trip_us: Annotated[float, Field(ge=0)] = 500.0
    # How holders sum a bucket's gradients and which communicators a plan needs
    # (planner.estimator.transition): "ring" (NCCL, HCCL) or "exchange" (chameleon_runtime on gloo).
    collectives: Literal["ring", "exchange"] = "ring"
    # CPU workers sharing their host's cores (0: a device per worker; unset: a device per
    # worker here, what the workers report under chameleon run --config), and how many
    # of the config's nodes one host carries (the CPU test bed: 2 "nodes" on one machine).
    host_cores: Annotated[int, Field(ge=0)] | None = None
    nodes_per_host: PositiveInt = 1
    # Mean time between failures of one device: D is this over the devices in use, then
    # learned from the failures a job sees (planner.job.failures). Default: Llama 3's rate.
    device_mtbf_hours: Positive = DEFAULT_DEVICE_MTBF_H


class GptConfig(_Strict):
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt | None = None
    ffn_hidden_size: PositiveInt | None = None
    gated_mlp: bool = False
    vocab_size: PositiveInt
    seq_len: PositiveInt

    @model_validator(mode="after")
    def _heads_divide(self) -> GptConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self


class LayerConfig(_Strict):
    name: str
    repeat: PositiveInt = 1
    num_params: Annotated[int, Field(ge=0)]
    forward_gflops_per_sample: Annotated[float, Field(ge=0)]
    backward_gflops_per_sample: Annotated[float, Field(ge=0)] | None = None  # default 2x forward
    activation_bytes_per_sample: Annotated[int, Field(ge=0)]
    stash_bytes_per_sample: Annotated[int, Field(ge=0)]


class ModelConfig(_Strict):
    name: str
    gpt: GptConfig | None = None
    layers: list[LayerConfig] | None = None
    cost_table: str | None = None  # path, relative to the config file

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        sources = [x for x in (self.gpt, self.layers, self.cost_table) if x is not None]
        if len(sources) != 1:
            raise ValueError("give exactly one of [model.gpt], [[model.layers]] or cost_table")
        return self


class TrainingConfig(_Strict):
    global_batch_size: PositiveInt
    micro_batch_size: PositiveInt
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    optimizer: Literal["adam", "sgd"] = "adam"
    activation_recompute: bool = False
    dp: PositiveInt
    pp: PositiveInt
    tp: PositiveInt = 1
    # HSDP: replica groups of this many workers, each holding the model sharded over its
    # members (the drop-in's sharded model: planner.job.fsdp); needs pp = 1.
    shards: PositiveInt = 1
    rank_order: RankOrder = RankOrder.TP_PP_DP
    mtbf_hours: Positive | None = None  # D fixed for the job; unset: from device_mtbf_hours
    checkpoint_interval_s: Positive = 1800.0
    # Bytes per parameter of the gradients a holder keeps between passes and all-reduces;
    # unset: 4. chameleon_runtime keeps fp32 master weights and gradients at every
    # precision (bf16 and fp16 only compute in the half type), and all-reduces them in
    # their dtype, as DDP does under autocast; Trainer(exact=True) keeps float64 sums (8).
    grad_sum_bytes: PositiveInt | None = None

    @model_validator(mode="after")
    def _batches(self) -> TrainingConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        if self.shards > 1 and (self.pp != 1 or self.dp % self.shards):
            raise ValueError(
                f"shards = {self.shards} shards whole-model replicas: it needs pp = 1 and dp a "
                "multiple of shards"
            )
        return self


class JobConfig(_Strict):
    cluster: ClusterConfig
    model: ModelConfig
    training: TrainingConfig


def load_job(path: str | Path) -> Job:
    """Read, validate and convert a config file; raises ConfigError."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a file: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        config = JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_field_messages(path, exc)) from None
    table = None
    if config.model.cost_table is not None:
        table = load_cost_table(path.parent / config.model.cost_table)
    return to_job(config, table)


def load_cost_table(path: Path) -> CostTable:
    try:
        return CostTable.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"cost table not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(_field_messages(path, exc)) from None


def _field_messages(path: Path, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{path}: {where}: {message}")
    return "\n".join(lines)


def _bytes_per_value(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _optimizer_bytes(training: TrainingConfig) -> int:
    """Adam keeps two fp32 moments, plus fp32 master weights in mixed precision; SGD
    keeps one momentum (and master weights in mixed precision)."""
    master = 0 if training.precision == "fp32" else 4
    moments = 8 if training.optimizer == "adam" else 4
    return master + moments


def to_job(config: JobConfig, table: CostTable | None = None) -> Job:
    c, t = config.cluster, config.training
    intra = Link(c.intra_node_bandwidth_gb_per_s * 1e9, c.intra_node_latency_us * 1e-6)
    inter = Link(c.inter_node_bandwidth_gb_per_s * 1e9, c.inter_node_latency_us * 1e-6)
    pg_base, pg_per, store_rt = (
        c.pg_init_base_s,
        c.pg_init_per_worker_s,
        c.store_round_trip_us * 1e-6,
    )
    if table is not None:
        intra = table.intra_node.to_link() if table.intra_node else intra
        inter = table.inter_node.to_link() if table.inter_node else inter
        pg_base = table.pg_init_base_s if table.pg_init_base_s is not None else pg_base
        pg_per = table.pg_init_per_worker_s if table.pg_init_per_worker_s is not None else pg_per
        store_rt = table.store_round_trip_s if table.store_round_trip_s is not None else store_rt
    # CPU figures only a profile measures: 0 (not charged) without one.
    profiled = {
        name: (getattr(table, name) if table is not None else None) or 0.0
        for name in (
            "move_cpu_s_per_param", "pack_cpu_s_per_param", "unpack_cpu_s_per_param",
            "message_cpu_s_per_byte", "tail_cpu_s_per_param",
        )
    }  # fmt: skip
    cluster = Cluster(
        name=c.name,
        num_nodes=c.num_nodes,
        devices_per_node=c.devices_per_node,
        device_memory_bytes=int(c.device_memory_gib * GiB),
        intra_node=intra,
        inter_node=inter,
        spare_nodes=c.spare_nodes,
        restart_s=c.restart_s,
        detection_s=c.detection_s,
        pg_init_base_s=pg_base,
        pg_init_per_worker_s=pg_per,
        store_round_trip_s=store_rt,
        **profiled,
        allreduce=c.collectives,
        intra_node_aggregate_bytes_per_s=(
            c.intra_node_aggregate_bandwidth_gb_per_s * 1e9
            if c.intra_node_aggregate_bandwidth_gb_per_s is not None
            else None
        ),
        device_mtbf_s=c.device_mtbf_hours * 3600,
        host_cores=c.host_cores,
        nodes_per_host=c.nodes_per_host,
    )
    act_bytes = _bytes_per_value(t.precision)
    training = Training(
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        param_bytes=act_bytes,
        grad_bytes=t.grad_sum_bytes or FP32_GRAD_BYTES,
        optimizer_bytes=_optimizer_bytes(t),
        dp=t.dp,
        pp=t.pp,
        tp=t.tp,
        rank_order=t.rank_order,
        mtbf_s=t.mtbf_hours * 3600 if t.mtbf_hours is not None else None,
        checkpoint_interval_s=t.checkpoint_interval_s,
        shards=t.shards,
    )
    m = config.model
    if table is not None:
        layers = table.to_layers(micro_batch_size=t.micro_batch_size, tp=t.tp)
        if c.host_cores and table.concurrent_workers > c.host_cores:
            # Measured while every worker measured at once: each had host_cores /
            # concurrent_workers of a core, so the times include the wait for one. The
            # shared-host model wants a layer's time on a core of its own.
            share = c.host_cores / table.concurrent_workers
            layers = tuple(
                replace(x, forward_s=x.forward_s * share, backward_s=x.backward_s * share,
                        optimizer_s=x.optimizer_s * share)
                for x in layers
            )  # fmt: skip
    else:
        flops = c.device_tflops * 1e12 * c.mfu * t.tp  # a worker's achieved FLOP/s
        per_param_optimizer_s = (
            2 * training.state_bytes_per_param / (c.memory_bandwidth_gb_per_s * 1e9 * t.tp)
        )
        specs = (
            m.layers
            if m.layers is not None
            else gpt_layers(m.gpt, act_bytes, t.activation_recompute)
        )  # type: ignore[arg-type]
        layers = tuple(
            layer
            for spec in specs
            for layer in _expand(
                spec, t, flops, per_param_optimizer_s, recompute=t.activation_recompute
            )
        )
    layers = fsdp_layers(layers, training, cluster)  # (sharded: planner.job.fsdp)
    job = Job(cluster=cluster, model=Model(name=m.name, layers=layers), training=training)
    if table is not None and table.steps is not None and c.host_cores:
        job = _fitted(job, table)
    return job


def _fitted(job: Job, table: CostTable) -> Job:
    """The job fitted to the real steps the profile ran (planner.estimator.fit): what a step costs
    beyond its layers on a host whose workers share the cores; and to its chain of
    transfers, what a transfer costs beyond its parts (planner.plans.migration)."""
    from planner.estimator.fit import fit_host
    from planner.plans.planjson import PlanWire

    steps = table.steps
    assert steps is not None
    plan = PlanWire.model_validate(steps.plan).to_plan()
    if not set(plan.workers) <= set(range(job.num_workers)):
        return job  # profiled on more workers than this config has: layer costs only
    fit = fit_host(
        job, plan, steps.step_s, steps.cpu_s, steps.compute_cpu_s, pass_cpu_s=steps.pass_cpu_s,
        alone_passes_cpu_s=steps.alone_passes_cpu_s,
    )  # fmt: skip
    job = fit.apply(job) if fit is not None else job
    chain = table.migration
    if chain is not None and chain.workers <= job.num_workers:
        from planner.plans.migration import fit_transfer_wait, ring

        wait = fit_transfer_wait(job, ring(job, chain.workers, chain.layer), chain.wall_s)
        job = replace(job, cluster=replace(job.cluster, transfer_wait_s=wait))
    return job


def _expand(
    spec: LayerConfig,
    t: TrainingConfig,
    flops: float,
    per_param_optimizer_s: float,
    *,
    recompute: bool,
) -> list[Layer]:
    b = t.micro_batch_size
    forward_s = spec.forward_gflops_per_sample * 1e9 * b / flops
    if spec.backward_gflops_per_sample is not None:
        backward_s = spec.backward_gflops_per_sample * 1e9 * b / flops
    else:
        backward_s = 2 * forward_s + (forward_s if recompute else 0.0)
    layer = Layer(
        name=spec.name,
        num_params=spec.num_params,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=spec.num_params * per_param_optimizer_s,
        # Sizes are the worker's totals: with tensor and sequence parallelism each of its
        # tp devices holds 1/tp of them, and the worker's memory is tp devices' worth.
        activation_bytes=spec.activation_bytes_per_sample * b,
        stash_bytes=spec.stash_bytes_per_sample * b,
    )
    if spec.repeat == 1:
        return [layer]
    return [replace(layer, name=f"{spec.name}.{i}") for i in range(spec.repeat)]


def gpt_layers(gpt: GptConfig, act_bytes: int, recompute: bool) -> list[LayerConfig]:
    """Embedding, transformer blocks and head of a decoder-only GPT, analytically.

    Parameters and FLOPs per sample (one sequence of s tokens) follow the usual counts:
    2 FLOPs per multiply-accumulate over every weight, plus 4*s^2*h for attention scores
    and their application. Stashed activations per block follow Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models"):
    s*h*(34 + 5*a*s/h) bytes at 16 bits, or only the block input (2*s*h) with full
    recomputation; scaled by 2 for fp32.
    """
    h, s, a, v = gpt.hidden_size, gpt.seq_len, gpt.num_heads, gpt.vocab_size
    kv = gpt.num_kv_heads or a
    ffn = gpt.ffn_hidden_size or 4 * h
    head_dim = h // a
    attn_params = 2 * h * h + 2 * h * kv * head_dim
    mlp_params = (3 if gpt.gated_mlp else 2) * h * ffn
    block_params = attn_params + mlp_params + 2 * h  # + two norms
    block_fwd = 2 * s * (attn_params + mlp_params) + 4 * s * s * h
    scale = act_bytes / 2
    block_stash = int((2 * s * h if recompute else s * h * (34 + 5 * a * s / h)) * scale)
    boundary = s * h * act_bytes
    head_fwd = 2 * s * h * v
    return [
        LayerConfig(
            name="embedding",
            num_params=v * h,
            forward_gflops_per_sample=0.0,
            backward_gflops_per_sample=0.0,
            activation_bytes_per_sample=boundary,
            stash_bytes_per_sample=0,
        ),
        LayerConfig(
            name="block",
            repeat=gpt.num_layers,
            num_params=block_params,
            forward_gflops_per_sample=block_fwd / 1e9,
            activation_bytes_per_sample=boundary,
            stash_bytes_per_sample=block_stash,
        ),
        LayerConfig(
            name="head",
            num_params=v * h + h,
            forward_gflops_per_sample=head_fwd / 1e9,
            activation_bytes_per_sample=0,
            # The input, plus fp32 logits for the loss.
            stash_bytes_per_sample=boundary + s * v * 4,
        ),
    ]

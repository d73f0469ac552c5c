"""What every training role (worker, chief, evaluator) sets up the same way.

The model and dataset from the training configuration, the parameter layout and placement
(computed from shapes alone, so every process derives the same map), a ps client, the
coordinator client, the metrics server, and the process's `stopping.Stop`: every client made
here ends its calls in flight when the task is told to stop.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient
from jaxps_runtime.config import cluster
from jaxps_runtime.config.training import OptimizerConfig, TrainingConfig
from jaxps_runtime.data import arrays
from jaxps_runtime.data import builtin as datasets
from jaxps_runtime.model import builtin as models
from jaxps_runtime.process import stopping
from jaxps_runtime.process.metrics import Metrics
from jaxps_runtime.train import outcome
from jaxps_runtime.train.coordinator import CoordinatorClient
from jaxps_runtime.wire import tables as wire_tables
from jaxps_runtime.wire.credentials import TaskCredentials

log = logging.getLogger(__name__)


@dataclass
class Task:
    """One task of a training job, with what it needs to play its role."""

    spec: cluster.TFConfig
    training: TrainingConfig
    job_id: str
    metrics: Metrics
    stop: stopping.Stop = field(default_factory=stopping.Stop)
    credentials: TaskCredentials | None = None  # mutual TLS with the job's CA; None: plaintext

    @property
    def name(self) -> str:
        return self.spec.task.name

    @property
    def worker_names(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.spec.cluster.num_tasks(cluster.WORKER))]

    @property
    def chief_address(self) -> str:
        return self.spec.cluster.address(self.spec.cluster.chief_task())

    @functools.cached_property
    def model(self) -> models.Model:
        m = self.training.model
        return models.build_model(
            name=m.name, module=m.module, kwargs=m.kwargs, example=self._example
        )

    def _example(self) -> arrays.Batch:
        """The first held-out example, a batch of one (what a Flax Linen module initialises
        from; reading it is no training read)."""
        return {key: array[:1] for key, array in self.dataset.test().items()}

    @functools.cached_property
    def dataset(self) -> arrays.Dataset:
        d = self.training.dataset
        return datasets.build_dataset(
            name=d.name, module=d.module, kwargs=d.kwargs, seed=self.training.seed
        )

    @functools.cached_property
    def shapes(self) -> Any:
        """The parameter pytree as ShapeDtypeStructs: no values computed."""
        return jax.eval_shape(self.model.init, jax.random.PRNGKey(self.training.seed))

    @functools.cached_property
    def layout(self) -> placement.Layout:
        return placement.named_leaves(self.shapes)[0]

    @functools.cached_property
    def placement(self) -> placement.Placement:
        p = self.training.placement
        num_ps = self.spec.cluster.num_tasks(cluster.PS)
        variables = [
            placement.Variable(v.name, (num_ps * spec.max_rows, spec.dim), "float32")
            if (spec := self.dynamic.get(v.name)) is not None
            else v
            for v in placement.variables_of(self.shapes)
        ]
        return placement.plan(
            variables,
            num_ps=num_ps,
            strategy=p.strategy,
            min_shard_bytes=p.minShardBytes,
            dynamic=set(self.dynamic),
        )

    @functools.cached_property
    def dynamic(self) -> dict[str, wire_tables.Spec]:
        """The dynamic embedding tables (`training.embeddings`): {variable: the spec of one
        ps's part, its maxRows the job's split over the ps}. Each must be a table the model
        reads sparsely, of the dim its init makes; else `outcome.InvalidTrainingError`."""
        embeddings = self.training.embeddings
        if not embeddings:
            return {}
        num_ps = self.spec.cluster.num_tasks(cluster.PS)
        sparse = dict(self.model.sparse)
        _, leaves = placement.named_leaves(self.shapes)
        out = {}
        for table, config in sorted(embeddings.items()):
            where = f"training.embeddings.{table}"
            name = jax.tree_util.keystr((jax.tree_util.DictKey(table),))
            if table not in sparse:
                raise outcome.InvalidTrainingError(
                    f"{where}: the model reads no table {table!r} by ids (its sparse tables: "
                    f"{', '.join(sorted(sparse)) or 'none'})"
                )
            shape = tuple(np.shape(leaves[name])) if name in leaves else ()
            if len(shape) != 2 or shape[1] != config.dim:
                raise outcome.InvalidTrainingError(
                    f"{where}.dim: {config.dim}, but the model's init makes {table!r} of shape "
                    f"{list(shape)}: dim is its second dimension"
                )
            out[name] = wire_tables.Spec(
                name=table,
                dim=config.dim,
                max_rows=-(-config.maxRows // num_ps),
                min_count=config.admission.minCount,
                probability=config.admission.probability,
                eviction="lfu" if config.eviction == "lfu" else "lru",
                scale=config.initializer.scale,
                seed=self.training.seed,
            )
        return out

    @functools.cached_property
    def tables(self) -> dict[str, str]:
        """Embedding tables pulled by rows: variable name -> batch key of its row ids."""
        return {
            jax.tree_util.keystr((jax.tree_util.DictKey(table),)): key
            for table, key in self.model.sparse.items()
        }

    @property
    def optimizers(self) -> dict[str, OptimizerConfig]:
        """Variables with an optimizer of their own ({variable: optimizer}; a program's
        `session(optimizers=...)`); every other one is updated by `training.optimizer`."""
        return dict(getattr(self.model, "optimizers", None) or {})

    @property
    def dense_variables(self) -> list[str]:
        return [v.name for v in self.placement.variables if v.name not in self.tables]

    def initial_params(self) -> dict[str, np.ndarray]:
        with outcome.user_code("the model's init", task=self.name):
            params = self.model.init(jax.random.PRNGKey(self.training.seed))
        return {n: np.asarray(v) for n, v in placement.named_leaves(params)[1].items()}

    def ps_client(self, *, stop: stopping.Stop | None = None) -> PsClient:
        """A client of the ps tier whose calls end when `stop` (default: the task's) is set."""
        return PsClient(
            addresses=self.spec.cluster.addresses(cluster.PS),
            placement=self.placement,
            job_id=self.job_id,
            task=self.name,
            stop=stop or self.stop,
            credentials=self.credentials,
            use_bulk=cluster.bulk_on(os.environ),
            dynamic=self.dynamic,
        )

    @functools.cached_property
    def incarnation(self) -> int:
        """This process start's id, the same on every channel to the chief."""
        return secrets.randbits(62) | 1

    def coordinator(self, *, stop: stopping.Stop | None = None) -> CoordinatorClient:
        """A link to the chief whose calls end when `stop` (default: the task's) is set."""
        return CoordinatorClient(
            address=self.chief_address,
            job_id=self.job_id,
            task=self.name,
            incarnation=self.incarnation,
            stop=stop or self.stop,
            credentials=self.credentials,
        )

    @functools.cached_property
    def _evaluate(self) -> Any:
        return jax.jit(self.model.evaluate)

    def test_rows(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """What an evaluation reads of the dynamic tables: ({table: the held-out set's ids,
        each once}, the held-out set with those ids remapped to positions in them); ({}, None:
        the set as it is) without dynamic tables."""
        if not self.dynamic:
            return {}, None
        with outcome.user_code("the dataset's test split", task=self.name):
            test = dict(self.dataset.test())
        rows = {}
        for variable, key in self.tables.items():
            if variable in self.dynamic:
                unique, _, inverse = wire_tables.dedup(np.asarray(test[key]))
                rows[variable], test[key] = unique, inverse
        return rows, test

    def evaluate(self, params: Any, test: dict[str, np.ndarray] | None = None) -> dict[str, float]:
        """The model's metrics on the whole held-out set (`test`: as `test_rows` remapped it);
        `outcome.UserCodeError` when the model's evaluate or the dataset's test raises."""
        if test is None:
            with outcome.user_code("the dataset's test split", task=self.name):
                test = self.dataset.test()
        with outcome.user_code("the model's evaluate", task=self.name):
            values = self._evaluate(params, test)
            return {k: float(v) for k, v in values.items()}

"""Codegen: Plan + captured graph -> per-stage GraphModules (``split_graph``, ``place_stages``)."""

from fxsplit.codegen.batchnorm import BatchNormTracker, defer_batch_norm
from fxsplit.codegen.place import place_stages
from fxsplit.codegen.split import Stage, StagedProgram, split_graph, stage_of_nodes

__all__ = ["BatchNormTracker", "defer_batch_norm", "Stage", "StagedProgram", "place_stages", "split_graph", "stage_of_nodes"]

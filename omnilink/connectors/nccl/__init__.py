"""The ``nccl`` backend: GPU-to-GPU transfer through ``torch.distributed`` point-to-point.

This package is the public door of the backend; its modules are internal:

=============  ==========================================================================
``connector``  ``NcclConnector``: its own two-rank process groups (NCCL on GPUs, gloo on
               CPU; a slot and a bulk group per direction), the credit socket, the
               receiving threads, put / get
``wire``       the slot (head, envelope, small tensors) and the credit, the pack and
               slot layouts of small tensors, and their validation
=============  ==========================================================================

Exports: ``NcclConnector``.
"""

from __future__ import annotations

from omnilink.connectors.nccl.connector import NcclConnector

__all__ = ["NcclConnector"]

"""The ``nccl`` backend: GPU-to-GPU transfer through ``torch.distributed`` point-to-point.

This package is the public door of the backend; its modules are internal:

=============  ==========================================================================
``connector``  ``NcclConnector``: its own two-rank process groups (NCCL on GPUs, gloo on
               CPU; one bulk group per direction), the doorbell (``omnilink.connectors.bell``) and credit sockets,
               put / get (a get reads the doorbell itself), the keeper thread
``wire``       the doorbell message (envelope, inline data, region of small device
               tensors) and the credit, the pack and region layouts, and the
               validation of a doorbell before anything is allocated (``read_bell``)
=============  ==========================================================================

Exports: ``NcclConnector``.
"""

from __future__ import annotations

from omnilink.connectors.nccl.connector import NcclConnector

__all__ = ["NcclConnector"]

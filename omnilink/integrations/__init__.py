"""Integrations of omnilink with serving engines.

Each integration lives in its own module and imports its engine only when used, so
``import omnilink`` (and ``import omnilink.integrations``) never imports an engine:

- ``omnilink.integrations.vllm_omni``: ``OmnilinkConnector``, a connector for
  vLLM-Omni's ``OmniConnectorFactory``, and ``register()``, which vLLM-Omni calls at
  start-up through the ``vllm_omni.general_plugins`` entry point.
"""

from __future__ import annotations

__all__: list[str] = []

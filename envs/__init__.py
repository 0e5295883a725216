"""Environments for agents: one async protocol, in process or over the network.

- ``envs.base``: the :class:`Env` protocol, actions, observations, the error tree;
- ``envs.registry``: ids ``namespace/Name-vN``, ``register``/``make``, ``resolve`` for
  the specs the REST API stores (``envs.specs``);
- ``envs.builtin``: guess-number, calc-tool (a sandboxed ``python`` tool) and lookup,
  each with a scripted oracle;
- ``envs.server`` / ``envs.client``: the env server (HTTP sessions, OpenEnv-compatible
  ``/ws``) and ``RemoteEnv``;
- ``envs.adapters``: Gymnasium and TextArena envs as ours, and ours as Gymnasium envs.

This package imports nothing from the gateway or the trainer; it may use ``sandbox``.
"""

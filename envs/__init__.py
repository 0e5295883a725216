"""Environments for agents: one async protocol, in process or over the network.

- ``envs.base``: the :class:`Env` protocol, actions, observations, the error tree;
- ``envs.registry``: ids ``namespace/Name-vN``, ``register``/``make``, and the kinds of
  spec the REST API stores (``parse_spec``, ``resolve``; the models in ``envs.specs``).
  It knows no env family: each registers itself through an ``agentflow.envs`` entry
  point (pyproject.toml), loaded on the registry's first use;
- ``envs.builtin``: guess-number, calc-tool (a sandboxed ``python`` tool), lookup and
  more, each with a scripted oracle;
- ``envs.server`` / ``envs.client``: the env server (HTTP sessions, OpenEnv-compatible
  ``/ws``) and ``RemoteEnv``;
- ``envs.adapters``: Gymnasium and TextArena envs as ours, and ours as Gymnasium envs;
- ``envs.browser``, ``envs.desktop``: computer use, in Chromium and on desktops.

This package imports nothing from the gateway or the trainer; it may use ``sandbox``.
"""

"""Placement of a run's parts as Ray actors (docs/ray.md).

Ray is an optional extra (`pip install 'agentflow[ray]'`): nothing outside this package
imports it, and this package is imported only when a run's `[placement] ray` is set.
"""

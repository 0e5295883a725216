"""Built-in multi-turn envs with verifiable rewards, each with a scripted oracle policy.

- ``agentflow/guess-number-v0`` (``guess_number``): find a hidden number with
  higher/lower feedback;
- ``agentflow/calc-tool-v0`` (``calc_tool``): an arithmetic word problem, computed with a
  ``python`` tool that runs in a sandbox;
- ``agentflow/lookup-v0`` (``lookup``): a question answered by chaining ``lookup`` calls
  on a small key-value store.

Each module has an ``oracle``.
An oracle is a function ``oracle(history: Sequence[Observation]) -> Action`` that depends
only on the observations so far (it replays its own earlier choices), so the same oracle
serves tests, warm-start data and baselines.
"""

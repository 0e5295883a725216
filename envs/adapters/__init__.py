"""Adapters between our Env protocol and other env suites.

- ``gym_text``: Gymnasium toy-text envs (FrozenLake, Blackjack) with text observations
  and lenient text actions, as our envs;
- ``textarena_games``: TextArena two-player board games (TicTacToe, ConnectFour) against
  a fixed opponent, as our envs;
- ``as_gymnasium``: the reverse, any of our envs as a ``gymnasium.Env`` with ``Text``
  action and observation spaces.

Each module imports its third-party suite itself, so importing ``envs`` never needs them.
"""

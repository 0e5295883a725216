"""AgentFlow: fully asynchronous RL for LLM agents."""

__version__ = "0.1.0"

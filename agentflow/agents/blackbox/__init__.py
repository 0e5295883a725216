"""Black-box agents: the OpenAI-compatible proxy and the `http` and `container` kinds.

See `docs/blackbox-agents.md` for the flow, the reward sources and the network model.
"""

from agentflow.agents.blackbox.container_agent import ContainerAgent
from agentflow.agents.blackbox.http_agent import HttpAgent
from agentflow.agents.blackbox.live import AgentReport, LiveEpisodes, TooManyRequests

__all__ = ["AgentReport", "ContainerAgent", "HttpAgent", "LiveEpisodes", "TooManyRequests"]

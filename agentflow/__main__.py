from agentflow.cli import main

main()

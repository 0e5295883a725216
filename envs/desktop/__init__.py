"""Desktop envs: OSWorld-style tasks on a desktop driven through its noVNC page.

A `DesktopProvider` (provider.py) hands out desktops: the local one (local.py) starts
Xvfb + openbox + x11vnc + websockify/noVNC per desktop; the remote one (remote.py) only
connects to a VM's noVNC page. `DesktopEnv` (env.py) opens that page in Chromium through
Playwright and plays OSWorld `computer_13` actions (actions.py) on its canvas; the
task's checker (tasks.py, checkers.py) reads the desktop's state and gives the reward.

Importing this package is light: Playwright is imported only when a desktop is viewed.
"""

# The desktop service: one Xvfb desktop (openbox, xterm), x11vnc, websockify serving
# noVNC, and the OSWorld-style state server, all from `agentflow desktop serve`.
#
# FROM the agentflow image (`agentflow stack build` builds it first): the state server
# is AgentFlow's own code, so it comes from the same wheels. Only Debian packages are
# added here, with apt during the build (host networking); nothing reaches a package
# index. The Dockerfile copies nothing, so its build context can be anything.
ARG AGENTFLOW_IMAGE=agentflow:local
FROM ${AGENTFLOW_IMAGE}

# x11-utils: xprop (the window manager's readiness) and xwininfo; xdotool: the terminal's
# readiness and the window checkers; fonts-dejavu-core: the terminal's font.
USER root
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        xvfb openbox x11vnc websockify novnc xterm xdotool x11-utils fonts-dejavu-core \
    && rm -rf /var/lib/apt/lists/*

# The desktop runs as the image's unprivileged user: commands sent to the state server
# and apps in the desktop run as that user, in its home, never as root.
USER agentflow
ENV HOME=/home/agentflow \
    AGENTFLOW_DESKTOP_RUNTIME_DIR=/tmp/agentflow-desktops
WORKDIR /home/agentflow
CMD ["agentflow", "desktop", "serve"]
LABEL org.agentflow.image="agentflow-desktop"

# Versions the end-to-end run installs (install.sh) and expects (run.sh).
# code-server 4.139.1 is VS Code 1.139.1; it needs Node 24.
CODE_SERVER_VERSION=4.139.1
PLAYWRIGHT_VERSION=1.65.2
NODE_MAJOR=24

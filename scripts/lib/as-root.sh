# Sourced by the scripts that need root (setup.sh, test.sh, serve): on a root shell they
# run as they are; otherwise they run again through sudo, keeping the environment (the
# AENV_* settings). The README's commands so work both on a bare root shell without sudo
# and for a user with sudo.
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "$(basename "$0"): needs root, and sudo is not installed: run it as root" >&2
    exit 1
  fi
  exec sudo --preserve-env "$0" "$@"
fi

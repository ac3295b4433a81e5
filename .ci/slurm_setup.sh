#!/usr/bin/env bash
# Install the Debian packages that the SLURM sweep tests need (tests/test_slurm.py):
# slurmctld + slurmd + client tools (slurm-wlm), munge, and slurmdbd + MariaDB so that
# `sacct` works (submitit needs it to notice a task killed from outside).
#
# Idempotent and fast when everything is installed already (no apt-get update then).
# Never fails the CI run: on a machine without apt-get or root it prints why and exits 0,
# and the slurm tests then skip with that reason.
#
# Usage: bash .ci/slurm_setup.sh
set -uo pipefail

PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
NEEDED=(/usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch /usr/bin/sacct
        /usr/sbin/munged /usr/sbin/slurmdbd /usr/sbin/mariadbd)

missing=0
for f in "${NEEDED[@]}"; do [ -x "$f" ] || missing=1; done
if [ "$missing" = 0 ]; then
    echo "slurm_setup: SLURM, munge, slurmdbd and MariaDB already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "slurm_setup: no apt-get on this machine; SLURM tests will skip" >&2
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "slurm_setup: not root, cannot install ${PACKAGES[*]}; SLURM tests will skip" >&2
    exit 0
fi

t0=$(date +%s)
log=$(mktemp)
if apt-get update >"$log" 2>&1 &&
   DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>"$log" 2>&1; then
    echo "slurm_setup: installed ${PACKAGES[*]} in $(( $(date +%s) - t0 )) s"
else
    echo "slurm_setup: apt-get failed (SLURM tests will skip); last lines:" >&2
    tail -n 20 "$log" >&2
fi
rm -f "$log"
exit 0

#!/usr/bin/env bash
# A throw-away single-node SLURM cluster on this machine (as root; tests/test_slurm.py), from the scripts in
# ../shared/tools/slurm/ (or $KVBENCH_SLURM_TOOLS); install SLURM first: bash .ci/slurm_setup.sh
# Usage: slurm/cluster.sh start | stop [--purge] | status
set -euo pipefail

TOOLS=${KVBENCH_SLURM_TOOLS:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/shared/tools/slurm}

case "${1:-}" in
    start | stop)  # then on to the command's own case below
        [ -x "$TOOLS/${1}_slurm.sh" ] || { echo "cluster.sh: $TOOLS/${1}_slurm.sh not found: the test cluster's" \
            "scripts live in ../shared/tools/slurm beside the repository (or set KVBENCH_SLURM_TOOLS)" >&2; exit 3; }
        ;;&
    start)
        command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] ||
            { echo "cluster.sh: SLURM is not installed; run: bash .ci/slurm_setup.sh" >&2; exit 3; }
        # start_slurm.sh writes /etc/slurm/slurm.conf: never over a real cluster's configuration
        [ ! -s /etc/slurm/slurm.conf ] || head -n 1 /etc/slurm/slurm.conf | grep -q "config for CI" ||
            { echo "cluster.sh: /etc/slurm/slurm.conf is not the test cluster's; not replacing it" >&2; exit 3; }
        exec "$TOOLS/start_slurm.sh"
        ;;
    stop) exec "$TOOLS/stop_slurm.sh" "${@:2}" ;;
    status) sinfo && squeue ;;
    *)
        echo "usage: $0 start | stop [--purge] | status" >&2
        exit 2
        ;;
esac

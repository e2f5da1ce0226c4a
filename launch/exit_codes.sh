# shellcheck shell=bash
# megatron_ext/errors.py's exit codes, generated from it: python -c 'from megatron_ext.errors import
# exit_codes_shell; print(exit_codes_shell(), end="")' > launch/exit_codes.sh
# shellcheck disable=SC2034  # sourced: the scripts that source it use these
EXIT_FAILED=1
EXIT_USER_ERROR=2
EXIT_DIVERGED=3
EXIT_HUNG=4
EXIT_PEER_FAILED=5
EXIT_STORAGE=6
EXIT_RERUN_ELSEWHERE=16

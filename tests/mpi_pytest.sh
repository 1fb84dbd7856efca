#!/usr/bin/env bash
# Run pytest on one MPI rank (exec'd by mpiexec for every rank).
# Rank 0 reports to the terminal; the other ranks write .pytest-rank<N>.log and
# print it only when they fail, so the summary stays readable and nothing is lost.
set -u
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
if [ "$rank" = 0 ]; then
  exec "$py" -m pytest --with-mpi -m mpi -p no:cacheprovider "$@"
fi
log=".pytest-rank${rank}.log"
"$py" -m pytest --with-mpi -m mpi -p no:cacheprovider -q "$@" >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "=== rank $rank failed (rc=$rc); its log follows ===" >&2
  cat "$log" >&2
fi
exit $rc

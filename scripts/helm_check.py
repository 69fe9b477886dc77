"""Validates the Helm chart offline, as closely as the field's tools allow without a cluster.

For every values profile in helm/sluice/ci/*-values.yaml (the chart-testing convention):
  1. `helm lint --strict` and a render, through Helm's own Go SDK (helm-python-sdk);
  2. every core object against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
     unknown fields are errors);
  3. every custom resource (ScaledObject, ServiceMonitor, PodMonitor, PrometheusRule) against the
     openAPIV3Schema of the CRD its project publishes (tests/crds, see SOURCES.md), unknown fields
     rejected as `kubectl --validate=strict` would; the KEDA Kafka trigger's metadata against the
     parameters the scaler's source declares;
  4. assertions a reviewer would otherwise check by eye (grace period > drain, KEDA's maximum <=
     partitions, GPU request in the GPU profile, hardened security contexts, every SLUICE_*
     variable known to the binaries, the embedded alert rules and dashboard equal to their files).
Then the failures that must happen: bad values rejected by values.schema.json, KEDA's maximum
above the partitions refused at render time. The rendered manifests go to $1 (for checkov).

Usage: helm_check.py CHART RENDER_DIR REPO_ROOT
"""

import copy
import json
import pathlib
import re
import sys

import helm_python
import kubernetes_validate
import yaml
from jsonschema import Draft7Validator

chart_dir, out_dir, repo = (pathlib.Path(a) for a in sys.argv[1:4])
KUBE_VERSION = "1.30.0"
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
failures = []


def check(ok, message):
    if not ok:
        failures.append(message)
    return ok


def strict(schema):
    """The schema with unknown fields rejected wherever the CRD does not keep them."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


crd_schemas = {}
for path in sorted((chart_dir / "tests/crds").glob("*.yaml")):
    crd = yaml.safe_load(path.read_text())
    for version in crd["spec"]["versions"]:
        key = (f'{crd["spec"]["group"]}/{version["name"]}', crd["spec"]["names"]["kind"])
        crd_schemas[key] = Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))
kafka_parameters = json.loads((chart_dir / "tests/crds/keda-kafka-scaler-parameters.json").read_text())["parameters"]

# The environment variables the binaries read (clap `env = "..."`), and the AWS ones object_store reads.
known_env = set()
for source in list((repo / "worker/src").rglob("*.rs")) + list((repo / "producer/src").rglob("*.rs")) + list(
    (repo / "service/src").rglob("*.rs")
):
    known_env.update(re.findall(r'env = "([A-Z0-9_]+)"', source.read_text()))
known_env.update({"SLUICE_MODELS_URL", "POD_NAME"})

alerts = yaml.safe_load((chart_dir / "files/alerts.yaml").read_text())
dashboard = json.loads((chart_dir / "files/dashboard.json").read_text())
chart = helm_python.Chart.load(str(chart_dir))


def render(values):
    chart.validate_schema(values)
    rendered = chart.render(values, name="sluice", namespace="sluice", is_install=True)
    docs = []
    for name, text in sorted(rendered.items()):
        if name.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append((name, doc))
    return docs


def containers(doc):
    spec = doc.get("spec", {})
    if doc["kind"] == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    pod = spec.get("template", {}).get("spec") if "template" in spec else spec if doc["kind"] == "Pod" else None
    if not pod:
        return None, []
    return pod, pod.get("containers", []) + pod.get("initContainers", [])


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


profiles = sorted((chart_dir / "ci").glob("*-values.yaml"))
check(len(profiles) >= 3, f"expected at least three values profiles, found {len(profiles)}")
for profile in profiles:
    name = profile.name.removesuffix("-values.yaml")
    values = yaml.safe_load(profile.read_text())
    report = helm_python.lint(str(chart_dir), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    for message in report["messages"]:
        # Severity 1 is INFO (e.g. "icon is recommended"); warnings and errors fail.
        check(message["severity"] < 2, f"{name}: helm lint: {message}")
    for error in report.get("errors", []):
        check(False, f"{name}: helm lint: {error}")
    docs = render(values)
    kinds = sorted(f'{d["kind"]}' for _, d in docs)
    print(f"{name}: {len(docs)} objects: {', '.join(kinds)}")
    target = out_dir / name
    target.mkdir(parents=True, exist_ok=True)
    for i, (template, doc) in enumerate(docs):
        (target / f'{i:02d}-{doc["kind"].lower()}-{doc["metadata"]["name"]}.yaml').write_text(yaml.safe_dump(doc))
        where = f'{name}: {doc["kind"]}/{doc["metadata"]["name"]} ({template})'
        if doc["kind"] in CRD_KINDS:
            validator = crd_schemas.get((doc["apiVersion"], doc["kind"]))
            if check(validator is not None, f"{where}: no published CRD schema for {doc['apiVersion']}"):
                for error in validator.iter_errors({k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}):
                    check(False, f"{where}: {'/'.join(map(str, error.path))}: {error.message}")
        else:
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                check(False, f"{where}: {'/'.join(map(str, e.path))}: {e.message}")
        pod, cs = containers(doc)
        if pod is not None:
            check(pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{where}: runAsNonRoot")
            check(pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccomp")
            for c in cs:
                sc = c.get("securityContext", {})
                check(sc.get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}: readOnlyRootFilesystem")
                check(sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}: allowPrivilegeEscalation")
                check(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}: drop ALL")
                check("limits" in c.get("resources", {}) and "requests" in c["resources"], f"{where}/{c['name']}: resources")
                for var in env_of(c):
                    if var.startswith("SLUICE_"):
                        check(var in known_env, f"{where}/{c['name']}: {var} is read by no binary")

    by_kind = {}
    for _, doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    worker = next(d for d in by_kind["StatefulSet"] if d["metadata"]["name"].endswith("-worker"))
    wpod = worker["spec"]["template"]["spec"]
    wc = next(c for c in wpod["containers"] if c["name"] == "worker")
    wenv = env_of(wc)
    drain_ms = int(wenv["SLUICE_SHUTDOWN_GRACE_MS"])
    check(
        wpod["terminationGracePeriodSeconds"] * 1000 >= drain_ms + 5000,
        f"{name}: the worker's grace period ({wpod['terminationGracePeriodSeconds']} s) must exceed its drain ({drain_ms} ms) by 5 s",
    )
    check(wenv.get("SLUICE_GROUP_INSTANCE_ID") == "$(POD_NAME)", f"{name}: static membership from the pod name")
    check(wc["readinessProbe"]["httpGet"]["path"] == "/readyz", f"{name}: worker readiness on /readyz")
    check(wc["livenessProbe"]["httpGet"]["path"] == "/healthz", f"{name}: worker liveness on /healthz")
    startup = wc["startupProbe"]
    check(startup["periodSeconds"] * startup["failureThreshold"] >= 300, f"{name}: the startup probe allows 5 min for a model load")
    gpu = values.get("worker", {}).get("gpu", {})
    limits = wc["resources"]["limits"]
    if gpu.get("enabled"):
        resource = gpu.get("resourceName", "nvidia.com/gpu")
        check(limits.get(resource) == gpu.get("count", 1), f"{name}: GPU limit {resource} in the GPU profile")
        check(wenv.get("SLUICE_DEVICE") == "cuda" and wenv.get("SLUICE_REQUIRE_GPU") == "true", f"{name}: CUDA required on GPU pods")
        digest = values["worker"].get("image", {}).get("digest")
        if digest:
            check(wc["image"].endswith(f"@{digest}"), f"{name}: the worker image by digest: {wc['image']}")
            undigested = copy.deepcopy(values)
            undigested["worker"]["image"]["digest"] = ""
            docs_by_tag = render(undigested)
            images = [c["image"] for _, d in docs_by_tag for c in containers(d)[1] if c["name"] in ("worker", "sync-models")]
        else:
            images = [wc["image"]]
        check(all(i.endswith("-cuda13") for i in images), f"{name}: the CUDA 13 image on GPU pods (the default gpu.cuda): {images}")
    else:
        check(not any("gpu" in k for k in limits), f"{name}: no GPU limit in a CPU profile")
        check(wenv.get("SLUICE_DEVICE") == "cpu", f"{name}: CPU device")
    for so in by_kind.get("ScaledObject", []):
        partitions = values["kafka"]["tasksPartitions"]
        check(so["spec"]["maxReplicaCount"] <= partitions, f"{name}: maxReplicaCount {so['spec']['maxReplicaCount']} > {partitions} partitions")
        check("replicas" not in worker["spec"], f"{name}: KEDA owns the worker count (no replicas in the StatefulSet)")
        check(so["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"], f"{name}: ScaledObject targets the workers")
        scale_down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        check(scale_down["stabilizationWindowSeconds"] >= 300, f"{name}: scale-down stabilization")
        for trigger in so["spec"]["triggers"]:
            check(trigger["type"] == "kafka", f"{name}: trigger type {trigger['type']}")
            meta = trigger["metadata"]
            for key, value in meta.items():
                known = kafka_parameters.get(key)
                if check(known is not None and "triggerMetadata" in known["order"], f"{name}: KEDA's kafka scaler reads no metadata {key!r}"):
                    check("enum" not in known or value in known["enum"], f"{name}: {key}={value!r} not in {known.get('enum')}")
            for required in ("bootstrapServers", "consumerGroup", "topic", "lagThreshold", "activationLagThreshold"):
                check(required in meta, f"{name}: kafka trigger without {required}")
            check(meta["consumerGroup"] == wenv["SLUICE_GROUP_ID"], f"{name}: KEDA watches the workers' group")
        task_topics = [wenv["SLUICE_TASKS_TOPIC"]] + [
            t for t in (wenv.get("SLUICE_INTERACTIVE_TOPIC"), wenv.get("SLUICE_BATCH_TOPIC")) if t and t != wenv["SLUICE_TASKS_TOPIC"]
        ]
        watched = [t["metadata"]["topic"] for t in so["spec"]["triggers"]]
        check(watched == list(dict.fromkeys(task_topics)), f"{name}: KEDA watches each task topic once: {watched} against {task_topics}")
    if not values.get("keda", {}).get("enabled"):
        check(worker["spec"].get("replicas") == values.get("worker", {}).get("replicas", 1), f"{name}: fixed worker count")
    for rule in by_kind.get("PrometheusRule", []):
        check(rule["spec"] == alerts, f"{name}: the PrometheusRule differs from files/alerts.yaml")
    for cm in by_kind.get("ConfigMap", []):
        if cm["metadata"]["name"].endswith("-dashboard"):
            check(json.loads(cm["data"]["sluice.json"]) == dashboard, f"{name}: the dashboard ConfigMap differs from files/dashboard.json")
            check(cm["metadata"]["labels"].get("grafana_dashboard") == "1", f"{name}: the dashboard sidecar label")
    if values.get("monitoring", {}).get("serviceMonitor", {}).get("enabled"):
        monitored = {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for m in by_kind.get("ServiceMonitor", [])}
        check(monitored == {"producer", "worker"}, f"{name}: ServiceMonitors for {monitored}")
        for m in by_kind.get("ServiceMonitor", []):
            component = m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
            port = m["spec"]["endpoints"][0]["port"]
            check(port == ("metrics" if component == "producer" else "http"), f"{name}: {component} scraped on port {port}")
    producer = next(d for d in by_kind["Deployment"] if d["metadata"]["name"].endswith("-producer"))
    pc = producer["spec"]["template"]["spec"]["containers"][0]
    check(
        pc["readinessProbe"]["httpGet"]["path"] == "/readyz" and pc["livenessProbe"]["httpGet"]["path"] == "/healthz",
        f"{name}: producer ready on /readyz (status view caught up), alive on /healthz",
    )
    metrics_port = next((p["containerPort"] for p in pc["ports"] if p["name"] == "metrics"), None)
    check(
        metrics_port is not None and env_of(pc).get("SLUICE_METRICS_LISTEN") == f"0.0.0.0:{metrics_port}",
        f"{name}: the producer's metrics on their own port",
    )
    check("SLUICE_ALLOW_ANONYMOUS" not in env_of(pc), f"{name}: the producer is closed by default")
    mounts = {m["mountPath"] for m in pc["volumeMounts"]}
    check("/var/lib/sluice/status" in mounts, f"{name}: the status view's volume")
    check(env_of(pc).get("SLUICE_WORKER_GROUP") == wenv["SLUICE_GROUP_ID"], f"{name}: the producer measures the workers' group")

# What must be refused.
base = yaml.safe_load((chart_dir / "ci/gpu-keda-monitoring-values.yaml").read_text())
for label, change in [
    ("a GPU count of 0", lambda v: v["worker"]["gpu"].__setitem__("count", 0)),
    ("an unknown top-level value", lambda v: v.__setitem__("wokrer", {})),
    ("a malformed output URL", lambda v: v["s3"].__setitem__("outputUrl", "https://bucket")),
    ("an unknown models source", lambda v: v["models"].__setitem__("source", "git")),
]:
    bad = copy.deepcopy(base)
    change(bad)
    try:
        chart.validate_schema(bad)
        check(False, f"values.schema.json accepted {label}")
    except helm_python.HelmError:
        pass
for label, change, needle in [
    ("KEDA's maximum above the partitions", lambda v: v["kafka"].__setitem__("tasksPartitions", 8), "maxReplicaCount"),
    ("no catalog", lambda v: v.__setitem__("catalog", ""), "catalog"),
    ("models from S3 without a URL", lambda v: v["models"]["s3"].__setitem__("url", ""), "models.s3.url"),
    ("no source of API keys", lambda v: v.__setitem__("existingSecret", ""), "producer.allowAnonymous"),
    ("one topic for two lanes", lambda v: v["kafka"].setdefault("topics", {}).update({"interactive": "x.lanes", "batch": "x.lanes"}), "kafka.topics.batch"),
]:
    bad = copy.deepcopy(base)
    change(bad)
    try:
        render(bad)
        check(False, f"the chart rendered with {label}")
    except helm_python.HelmError as e:
        check(needle in str(e), f"{label}: the error does not name {needle}: {e}")

# Lanes kept in the tasks topic: KEDA watches that one topic, once, and the pods are told so.
tasks_topic = yaml.safe_load((chart_dir / "values.yaml").read_text())["kafka"]["topics"]["tasks"]
one_topic = copy.deepcopy(base)
one_topic["kafka"].setdefault("topics", {}).update({"interactive": "", "batch": tasks_topic})
rendered = [d for _, d in render(one_topic)]
so = next(d for d in rendered if d["kind"] == "ScaledObject")
check([t["metadata"]["topic"] for t in so["spec"]["triggers"]] == [tasks_topic], "lanes off: one trigger, the tasks topic")
worker = next(d for d in rendered if d["kind"] == "StatefulSet")
lane_env = env_of(next(c for c in worker["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"))
check(lane_env.get("SLUICE_INTERACTIVE_TOPIC") == "", "lanes off: SLUICE_INTERACTIVE_TOPIC empty")

# Anonymous access renders only when asked for by name, and then says so to the producer.
anonymous = copy.deepcopy(base)
anonymous["existingSecret"] = ""
anonymous["producer"]["allowAnonymous"] = True
producer = next(d for _, d in render(anonymous) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-producer"))
check(env_of(producer["spec"]["template"]["spec"]["containers"][0]).get("SLUICE_ALLOW_ANONYMOUS") == "true", "anonymous: SLUICE_ALLOW_ANONYMOUS")

if failures:
    print(f"\n{len(failures)} problem(s):", file=sys.stderr)
    for f in failures:
        print(f"  - {f}", file=sys.stderr)
    sys.exit(1)
print(f"chart: {len(profiles)} profiles linted, rendered and validated; refusals checked")

#!/usr/bin/env bash
# Creates (or updates) the Secrets the RayService and the Redis pods read, in
# the current namespace (or $NAMESPACE):
#
#   prefixserve-redis-acl    users.acl              the directory's ACL users: replicas write, routers
#                                                   only read, default user off (`prefixserve redis-acl`)
#   prefixserve-redis-urls   replica-url, router-url  those users' URLs (replica pods / router pods)
#   prefixserve-gcs-redis    password               the GCS fault-tolerance Redis
#   prefixserve-router-tls   tls.crt, tls.key, ca.crt   the routers' TLS: $TLS_CERT/$TLS_KEY/$TLS_CA,
#                                                   or a self-signed CA + certificate for the Services
#   prefixserve-tenants      tenants.yaml           API keys -> tenants (router/tenants.py): $TENANTS_FILE,
#                                                   or one tenant `default` with a generated key (printed)
#
#   deploy/kuberay/create-secrets.sh            # apply to the cluster
#   deploy/kuberay/create-secrets.sh --print    # print the Secrets as YAML, change nothing
#
# Needs kubectl, openssl, and prefixserve (or docker with the image, IMAGE=...).
set -euo pipefail
print=0
[ "${1:-}" = "--print" ] && print=1
ns_args=()
[ -n "${NAMESPACE:-}" ] && ns_args=(--namespace "$NAMESPACE")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

apply() {  # name, then kubectl create secret arguments
  local name=$1; shift
  if [ "$print" = 1 ]; then
    echo "---"
    kubectl create secret "$@" "$name" "${ns_args[@]}" --dry-run=client -o yaml
  else
    kubectl create secret "$@" "$name" "${ns_args[@]}" --dry-run=client -o yaml | kubectl apply -f - >&2
  fi
}

# Redis ACL users and their URLs.
export PREFIXSERVE_REDIS_REPLICA_PASSWORD=${PREFIXSERVE_REDIS_REPLICA_PASSWORD:-$(openssl rand -hex 24)}
export PREFIXSERVE_REDIS_ROUTER_PASSWORD=${PREFIXSERVE_REDIS_ROUTER_PASSWORD:-$(openssl rand -hex 24)}
if command -v prefixserve >/dev/null; then
  prefixserve redis-acl > "$work/users.acl" 2>/dev/null
else
  docker run --rm -e PREFIXSERVE_REDIS_REPLICA_PASSWORD -e PREFIXSERVE_REDIS_ROUTER_PASSWORD \
    "${IMAGE:-prefixserve:0.1.0-cpu}" prefixserve redis-acl > "$work/users.acl" 2>/dev/null
fi
redis=${REDIS_HOST:-prefixserve-redis:6379}
apply prefixserve-redis-acl generic --from-file=users.acl="$work/users.acl"
apply prefixserve-redis-urls generic \
  --from-literal=replica-url="redis://prefixserve-replica:$PREFIXSERVE_REDIS_REPLICA_PASSWORD@$redis/0" \
  --from-literal=router-url="redis://prefixserve-router:$PREFIXSERVE_REDIS_ROUTER_PASSWORD@$redis/0"
apply prefixserve-gcs-redis generic --from-literal=password="${GCS_REDIS_PASSWORD:-$(openssl rand -hex 24)}"

# The routers' TLS.
if [ -n "${TLS_CERT:-}" ]; then
  cp "$TLS_CERT" "$work/tls.crt"; cp "$TLS_KEY" "$work/tls.key"; cp "${TLS_CA:-$TLS_CERT}" "$work/ca.crt"
else
  openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=prefixserve-ca" \
    -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=prefixserve-grpc" -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
  printf 'subjectAltName=DNS:prefixserve-grpc,DNS:prefixserve-http,DNS:localhost,IP:127.0.0.1\n' > "$work/san.ext"
  openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial -days 365 \
    -extfile "$work/san.ext" -out "$work/tls.crt" 2>/dev/null
fi
apply prefixserve-router-tls generic --type=kubernetes.io/tls \
  --from-file=tls.crt="$work/tls.crt" --from-file=tls.key="$work/tls.key" --from-file=ca.crt="$work/ca.crt"

# Tenants.
if [ -n "${TENANTS_FILE:-}" ]; then
  cp "$TENANTS_FILE" "$work/tenants.yaml"
else
  key="sk-$(openssl rand -hex 20)"
  printf 'tenants:\n  - name: default\n    keys: [%s]\n' "$key" > "$work/tenants.yaml"
  echo "create-secrets.sh: one tenant 'default' with the API key $key (set TENANTS_FILE for yours)" >&2
fi
apply prefixserve-tenants generic --from-file=tenants.yaml="$work/tenants.yaml"

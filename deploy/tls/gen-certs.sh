#!/bin/sh
# Certificates for the extender's mutual TLS, as two Secrets on stdout:
#   vramshare-extender-tls   tls.crt/tls.key: serving certificate of
#                            vramshare-extender.vramshare-system.svc (and localhost/127.0.0.1, for
#                            `vramshare inspect` through kubectl port-forward); ca.crt: the CA whose client
#                            certificates may call the verbs
#   vramshare-scheduler-tls  tls.crt/tls.key: kube-scheduler's client certificate; ca.crt: the CA
#                            that signed the extender's serving certificate (mounted by both
#                            vramshare-scheduler and, on the DRA path, vramshare-dra-scheduler)
# One throw-away CA signs both leaf certificates; its key is never stored (deleted on exit), so
# nobody can mint another trusted client later: rotating means running this again.
#
#   deploy/tls/gen-certs.sh | kubectl apply -f -                 # install or rotate
#   kubectl -n vramshare-system rollout restart deploy/vramshare-scheduler   # after a rotation
#   kubectl -n vramshare-system rollout restart deploy/vramshare-dra-scheduler   # (DRA path too)
#
# Usage: gen-certs.sh [DAYS]   (validity of the leaf certificates, default 365). Needs openssl.
set -eu
DAYS="${1:-365}"
NS="vramshare-system"
SVC="vramshare-extender"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT INT TERM
cd "$dir"
umask 077

openssl ecparam -name prime256v1 -genkey -noout -out ca.key 2>/dev/null
openssl req -x509 -new -key ca.key -sha256 -days "$((DAYS + 30))" -subj "/CN=vramshare-extender-ca" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.crt 2>/dev/null

leaf() {  # leaf NAME CN EXTENSIONS
  openssl ecparam -name prime256v1 -genkey -noout -out "$1.key" 2>/dev/null
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days "$DAYS" \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}
leaf server "$SVC.$NS.svc" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:$SVC,DNS:$SVC.$NS,DNS:$SVC.$NS.svc,DNS:$SVC.$NS.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
leaf client "vramshare-scheduler" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"

b64() { base64 < "$1" | tr -d '\n'; }
secret() {  # secret NAME CERT KEY
  cat <<YAML
---
apiVersion: v1
kind: Secret
type: kubernetes.io/tls
metadata:
  name: $1
  namespace: $NS
  labels:
    app.kubernetes.io/part-of: vramshare
data:
  tls.crt: $(b64 "$2")
  tls.key: $(b64 "$3")
  ca.crt: $(b64 ca.crt)
YAML
}
secret vramshare-extender-tls server.crt server.key
secret vramshare-scheduler-tls client.crt client.key

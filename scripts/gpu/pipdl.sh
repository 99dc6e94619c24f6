# Sourced by the payload scripts: pipdl DIR SPEC... downloads cp312 manylinux x86-64 wheels (no deps) into DIR,
# for the lent GPU machine's Python (it has no network).
pipdl() {
  local d=$1; shift
  local plats=() n
  for n in 2_17 2_24 2_27 2_28 2_31 2_34; do plats+=(--platform manylinux_${n}_x86_64); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 "${plats[@]}" -d "$d" "$@"
}

#!/usr/bin/env bash
# How DRAM bandwidth divides between an emulated slice's copy and a streaming neighbour on the other
# SMs, for each neighbour kernel of benches/memory_contention.cu: first in one kernel whose blocks
# take their role from their SM (no MPS), then as two MPS clients of a private daemon, the client
# held to a 1g's, a 3g's and a 4g's percentage of the SMs and the neighbour keeping off the SMs the
# client ran on. Run on the GPU machine from the repository root; nvcc is in /usr/local/cuda/bin.
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH
bin=/tmp/memory_contention
nvcc -O3 -arch=sm_90a -o "$bin" benches/memory_contention.cu || exit 1
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.mem --format=csv,noheader
if [ -z "${SKIP_INKERNEL:-}" ]; then echo "== in one kernel, no MPS"; "$bin" inkernel; fi
mps=/tmp/contention-mps
rm -rf "$mps"; mkdir -p "$mps/pipe" "$mps/log"
export CUDA_MPS_PIPE_DIRECTORY="$mps/pipe" CUDA_MPS_LOG_DIRECTORY="$mps/log"
nvidia-cuda-mps-control -d || exit 1
stop() { echo quit | nvidia-cuda-mps-control; sleep 1; }
trap stop EXIT
echo "== two MPS clients"
# CLIENTS: `client` holds it to the percentage; `client_roles` runs it at 100 % on SMs 0..n-1 by
# their ids, as the one-kernel measurement does, but in a process of its own.
for how in ${CLIENTS:-client client_roles}; do
for slice in ${SLICES:-1g:13:16 2g:25:32 3g:46:60 4g:49:64}; do
    IFS=: read -r name percent sms <<<"$slice"
    [ "$how" = client_roles ] && percent=100
    for kind in ${KINDS:-copy_cs8 read_cs8 write_cs8 copy_plain8 read_cs16 tma_read tma_copy}; do
        dir=$(mktemp -d)
        # FOOTPRINT=1: the neighbour keeps off the SMs it finds full while the client fills its own,
        # rather than the ids the client saw (each MPS client numbers its SMs its own way).
        [ -n "${FOOTPRINT:-}" ] && touch "$dir/footprint"
        # TOP=1: the neighbour keeps off its own highest ids, as many as the client has.
        [ -n "${TOP:-}" ] && touch "$dir/top"
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 timeout 60 "$bin" neighbour "$kind" "$dir" > "$dir/neighbour.txt" 2>&1 &
        nb=$!
        line=$(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$percent timeout 60 "$bin" "$how" "$sms" "$dir" 2>&1 | tail -1)
        wait $nb
        echo "$how $name ($percent %) $kind: $line"
        grep -h "footprint:" "$dir/neighbour.txt" | sed 's/^/    /'
        echo "    $(tail -1 "$dir/neighbour.txt")"
        rm -rf "$dir"
    done
done
done
stop; trap - EXIT
echo "== MPS servers left: $(nvidia-smi --query-compute-apps=process_name --format=csv,noheader | grep -c mps-server)"
ps -eo pid,args | grep "[n]vidia-cuda-mps" || true

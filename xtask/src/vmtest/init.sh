#!/bin/sh
# The vmtest guest's /init (busybox sh, PID 1). Written by `cargo xtask vmtest` into every
# initramfs; the protocol and the plan format are specified in xtask/src/vmtest/plan.rs.
#
# 1. mounts the kernel's filesystems (proc, sys, dev, tracefs, debugfs, bpf, cgroup2 only);
# 2. loads /vmtest/modules/*.ko in their order, mounts the payload disk when there is one;
# 3. says `VMTEST boot pass`, then one `VMFEATURE` line per feature it probes for real;
# 4. runs each line of /vmtest/plan: a test whose needs include a feature this kernel lacks is
#    `not-runnable` with the lacking features named; the others run under a hard timeout, their
#    output is kept and shown on failure; leftovers (processes, cgroups, swap) are reported and
#    removed before the next test;
# 5. `VMTEST-END <n>` and power off.

/bin/busybox mkdir -p /proc /sys /dev /tmp /var/tmp /root /sbin /usr/bin /usr/sbin /run
/bin/busybox --install -s
. /vmtest/env
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LD_LIBRARY_PATH MOE_FIXTURES_DIR
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
ln -sf /proc/self/fd /dev/fd
hostname vmtest

up() { cut -d' ' -f1 /proc/uptime; }
line() { tr '\n' ' ' | tr -s ' ' | cut -c1-"${1:-300}"; }

echo "VMINFO kernel $(uname -r)"
echo "VMINFO arch $(uname -m)"
echo "VMINFO cpus $(grep -c ^processor /proc/cpuinfo) mem_kib $(awk '/^MemTotal/ {print $2}' /proc/meminfo)"

for m in /vmtest/modules/*.ko; do
    [ -e "$m" ] || continue
    insmod "$m" 2>/tmp/insmod.err || echo "VMINFO insmod-failed $m $(line < /tmp/insmod.err)"
done
if [ -n "$VMTEST_DISK_AT" ]; then
    mkdir -p "$VMTEST_DISK_AT"
    if mount -t ext4 /dev/vda "$VMTEST_DISK_AT" 2>/tmp/mount.err; then
        mkdir -p "$VMTEST_DISK_AT/tmp"
    else
        echo "VMINFO disk-mount-failed $(line < /tmp/mount.err)"
    fi
fi
echo "VMTEST boot pass $(uname -r) up, init at $(up) s"

# ---- features, each probed for real ------------------------------------------------------
FEATURES=" "
has() { case "$FEATURES" in *" $1 "*) return 0 ;; esac; return 1; }
feature() {
    name=$1
    shift
    if "$@" > /tmp/feature.out 2>&1; then
        FEATURES="$FEATURES$name "
        echo "VMFEATURE $name yes $(line < /tmp/feature.out)"
    else
        echo "VMFEATURE $name no $(line < /tmp/feature.out)"
    fi
}
probe_btf() {
    [ -s /sys/kernel/btf/vmlinux ] || { echo "no /sys/kernel/btf/vmlinux"; return 1; }
    echo "/sys/kernel/btf/vmlinux, $(wc -c < /sys/kernel/btf/vmlinux) bytes"
}
probe_cgroup2_memory() {
    c=$(cat /sys/fs/cgroup/cgroup.controllers)
    echo "cgroup2 controllers: $c"
    case " $c " in *" memory "*) return 0 ;; esac
    return 1
}
probe_psi() {
    [ -r /proc/pressure/memory ] || { echo "no /proc/pressure/memory (CONFIG_PSI)"; return 1; }
    echo "/proc/pressure/memory: $(head -n1 /proc/pressure/memory)"
}
probe_zram() {
    [ -e /sys/class/zram-control ] || [ -e /sys/block/zram0 ] || { echo "no zram device (CONFIG_ZRAM)"; return 1; }
    echo "zram: $(cat /sys/block/zram0/comp_algorithm 2>/dev/null)"
}
# Linux < 6.3 reads and writes zram pages through the driver's rw_page, bypassing the block
# layer: no block_bio_queue/complete for a zram swap-in.
probe_zram_bio() {
    has zram || { echo "no zram"; return 1; }
    if grep -qw zram_rw_page /proc/kallsyms; then
        echo "zram has rw_page (Linux < 6.3): its swap-ins bypass the block layer, no block_bio_* events"
        return 1
    fi
    echo "zram swap-ins are bios (block_bio_queue/complete)"
}
probe_cachestat() {
    grep -q 'sys_cachestat$' /proc/kallsyms || { echo "no cachestat syscall (Linux 6.5+)"; return 1; }
    echo "cachestat syscall present"
}
probe_filemap_fault() {
    [ -d /sys/kernel/tracing/events/filemap/mm_filemap_fault ] || { echo "no tracepoint filemap:mm_filemap_fault (Linux 6.10+)"; return 1; }
    echo "tracepoint filemap:mm_filemap_fault"
}
# A BPF program of type $1 (kprobe or fentry) on vfs_read, attached by bpftool and counted by
# the kernel (kernel.bpf_stats_enabled): it must have run after a read.
probe_bpf() {
    d=/sys/fs/bpf/vmtest-$1
    echo 1 > /proc/sys/kernel/bpf_stats_enabled
    if ! bpftool prog loadall /vmtest/bpf/$1.o "$d" autoattach > /tmp/bpf.out 2>&1; then
        echo "bpftool could not load it: $(tail -n 4 /tmp/bpf.out | line)"
        rm -rf "$d"
        return 1
    fi
    cat /proc/version /proc/cpuinfo > /dev/null
    n=$(bpftool prog show name "vmtest_$1" | sed -n 's/.*run_cnt \([0-9]*\).*/\1/p')
    rm -rf "$d"
    echo 0 > /proc/sys/kernel/bpf_stats_enabled
    if [ "${n:-0}" -gt 0 ]; then
        echo "a $1 program on vfs_read ran $n times"
    else
        echo "a $1 program on vfs_read loaded but never ran: $(line < /tmp/bpf.out)"
        return 1
    fi
}
# DAMON's sysfs interface with operation filters (6.3+): a scheme can be kept to one memcg.
probe_damon_filters() {
    [ -d /sys/kernel/mm/damon/admin ] || { echo "no /sys/kernel/mm/damon/admin (CONFIG_DAMON_SYSFS)"; return 1; }
    grep -qw damos_new_filter /proc/kallsyms || { echo "DAMON without operation filters (Linux 6.3+)"; return 1; }
    grep -qw damon_pa_apply_scheme /proc/kallsyms || { echo "DAMON without physical-address operations (CONFIG_DAMON_PADDR)"; return 1; }
    echo "DAMON sysfs admin tree, operation filters, paddr pageout"
}
while read -r name ok detail; do
    if [ "$ok" = yes ]; then FEATURES="$FEATURES$name "; fi
    echo "VMFEATURE $name $ok $detail"
done < /vmtest/host-features
feature btf probe_btf
feature cgroup2-memory probe_cgroup2_memory
feature psi probe_psi
feature zram probe_zram
feature zram-bio probe_zram_bio
feature cachestat probe_cachestat
feature mm_filemap_fault probe_filemap_fault
feature kprobe probe_bpf kprobe
feature fentry probe_bpf fentry
feature damon-filters probe_damon_filters

# ---- what a test leaves behind ------------------------------------------------------------
leftovers() {
    left=""
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [ "$pid" = 1 ] && continue
        readlink "$p/exe" > /dev/null 2>&1 || continue
        comm=$(cat "$p/comm" 2>/dev/null)
        kill -9 "$pid" 2>/dev/null
        # busybox's timeout watches from a child of its own that outlives the command a while.
        [ "$comm" = timeout ] || left="$left $pid:$comm"
    done
    for g in /sys/fs/cgroup/*/; do
        [ -d "$g" ] || continue
        left="$left cgroup:$(basename "$g")"
        echo 1 > "$g/cgroup.kill" 2>/dev/null
        sleep 0.2
        rmdir "$g" 2>/dev/null
    done
    if grep -q zram /proc/swaps; then
        left="$left swap:zram"
        swapoff -a
        for z in /sys/block/zram*; do echo 1 > "$z/reset"; done
    fi
    [ -n "$left" ] && echo "VMINFO leftover $1:$left"
}

# ---- the plan ------------------------------------------------------------------------------
n=0
TAB=$(printf '\t')
while IFS="$TAB" read -r name timeout needs kind cmd; do
    n=$((n + 1))
    lacks=""
    for f in $(echo "$needs" | tr ',' ' '); do
        [ "$f" = - ] || has "$f" || lacks="$lacks $f"
    done
    if [ -n "$lacks" ]; then
        echo "VMTEST $name not-runnable lacks:$lacks"
        continue
    fi
    t0=$(up)
    timeout -s KILL "$timeout" sh -c "$cmd" > /tmp/test.out 2>&1 < /dev/null
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')
    ok=no
    case $kind in
    rust) [ $rc = 0 ] && grep -q '^test result: ok. 1 passed' /tmp/test.out && ok=yes ;;
    *) [ $rc = 0 ] && ok=yes ;;
    esac
    if [ $ok = yes ]; then
        echo "VMTEST $name pass ${secs}s"
    else
        if [ $rc = 137 ]; then
            why="killed at its ${timeout}s timeout"
        else
            why="exit $rc: $(grep -A2 'panicked at' /tmp/test.out | tail -n 2 | line 400)"
        fi
        echo "VMTEST $name fail ${secs}s $why"
        echo "VMLOG-BEGIN $name"
        tail -n 60 /tmp/test.out
        echo "VMLOG-END $name"
    fi
    leftovers "$name"
done < /vmtest/plan
echo "VMINFO uptime $(up)"
echo "VMTEST-END $n"
sync
poweroff -f

// cpustat.go: where the two pinned CPUs' time went during a measurement, machine-wide
// (/proc/stat), and how often the server and the generator were preempted (/proc/PID/task).
//
// Why: a process's own CPU time (procCPU) leaves out softirq, and on loopback the receiving
// side's TCP work runs as softirq on the sender's CPU: under churn that is 15–22 % of each CPU,
// so "server 80 %" could be a CPU that was in fact full. Busy/idle per CPU says which side was
// saturated; steal says the hypervisor took the CPU; involuntary context switches say another
// task on this machine did (the machine is shared, and only our processes are pinned).
//
// Owns: cpuTimes, readCPUTimes, cpuString, preemptions. Must not touch: the measurements.

package main

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// cpuTimes is one CPU's time by kind.
type cpuTimes struct {
	busy    time.Duration // user, nice, system, irq, softirq
	softirq time.Duration // part of busy
	idle    time.Duration // idle and iowait
	steal   time.Duration // the hypervisor ran something else
}

func (c cpuTimes) sub(o cpuTimes) cpuTimes {
	return cpuTimes{c.busy - o.busy, c.softirq - o.softirq, c.idle - o.idle, c.steal - o.steal}
}

// readCPUTimes returns each CPU's times so far ("cpu0" ..., from /proc/stat).
func readCPUTimes() map[string]cpuTimes {
	m := map[string]cpuTimes{}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return m
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 9 || !strings.HasPrefix(f[0], "cpu") || f[0] == "cpu" {
			continue
		}
		var v [8]time.Duration // user nice system idle iowait irq softirq steal
		for i := range v {
			n, _ := strconv.ParseInt(f[1+i], 10, 64)
			v[i] = time.Duration(n) * time.Second / 100 // USER_HZ
		}
		m[f[0]] = cpuTimes{busy: v[0] + v[1] + v[2] + v[5] + v[6], softirq: v[6], idle: v[3] + v[4], steal: v[7]}
	}
	return m
}

// subCPUTimes returns the times spent between two readings.
func subCPUTimes(now, before map[string]cpuTimes) map[string]cpuTimes {
	d := make(map[string]cpuTimes, len(now))
	for cpu, v := range now {
		d[cpu] = v.sub(before[cpu])
	}
	return d
}

// cpuString formats each CPU's share of the measurement's time.
func cpuString(m map[string]cpuTimes) string {
	var parts []string
	for _, cpu := range slices.Sorted(maps.Keys(m)) {
		c := m[cpu]
		total := (c.busy + c.idle + c.steal).Seconds()
		if total <= 0 {
			continue
		}
		pc := func(d time.Duration) float64 { return 100 * d.Seconds() / total }
		parts = append(parts, fmt.Sprintf("%s busy %.0f%% (softirq %.0f%%) idle %.0f%% steal %.0f%%",
			cpu, pc(c.busy), pc(c.softirq), pc(c.idle), pc(c.steal)))
	}
	if len(parts) == 0 {
		return "?"
	}
	return strings.Join(parts, ", ")
}

// preemptions is how often a process's threads were switched out while runnable (the sum of
// nonvoluntary_ctxt_switches over /proc/PID/task/*/status): another task took its CPU.
func preemptions(pid int) int64 {
	paths, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	var n int64
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "nonvoluntary_ctxt_switches:"); ok {
				k, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				n += k
			}
		}
	}
	return n
}

// process_metrics.go: the daemon's own resources on /metrics (descriptors, memory, CPU,
// goroutines), under the names Prometheus's client libraries give them, so that the
// dashboards and alerts written for any exporter's process apply unchanged.
//
// A dispatcher runs for months on an appliance: what it holds must come back to the same
// level once its work is done, whatever that work was (workers started and killed, operators'
// actions, viewers, reloads). These are the figures that show whether it does
// (TestLongRunLeavesNoTrace), and that let an operator see a leak before the kernel kills
// the daemon for it.

package main

import (
	"fmt"
	"os"
	"runtime/metrics"
	"strconv"
	"strings"
	"syscall"
)

// runtimeSamples are the Go runtime's figures written: the goroutines now, the heap the last
// garbage collection found live (what the daemon keeps; the heap in use also counts garbage
// not yet collected), and the collections so far.
var runtimeSamples = []struct{ name, key, typ, help string }{
	{"go_goroutines", "/sched/goroutines:goroutines", "gauge", "Goroutines that currently exist."},
	{"go_gc_heap_live_bytes", "/gc/heap/live:bytes", "gauge", "Heap memory occupied by live objects, as marked by the last garbage collection."},
	{"go_gc_cycles_total", "/gc/cycles/total:gc-cycles", "counter", "Completed garbage collection cycles."},
}

// writeProcessMetrics adds the process's samples. A figure that cannot be read (another
// kernel than Linux's has no /proc) is left out, not written as 0.
func writeProcessMetrics(p *promWriter) {
	samples := make([]metrics.Sample, len(runtimeSamples))
	for i, r := range runtimeSamples {
		samples[i].Name = r.key
	}
	metrics.Read(samples)
	for i, r := range runtimeSamples {
		if samples[i].Value.Kind() == metrics.KindUint64 {
			p.sample(r.name, r.typ, r.help, "", samples[i].Value.Uint64())
		}
	}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		cpu := float64(ru.Utime.Sec+ru.Stime.Sec) + float64(ru.Utime.Usec+ru.Stime.Usec)/1e6
		p.sample("process_cpu_seconds_total", "counter", "User and system CPU time spent in seconds.", "", fmt.Sprintf("%.3f", cpu))
	}
	// A process may always read its own descriptors' directory, also after the privilege
	// drop has made it non-dumpable (and /proc/self root's).
	if fds, err := os.ReadDir("/proc/self/fd"); err == nil {
		p.sample("process_open_fds", "gauge", "Number of open file descriptors.", "", len(fds)-1) // less the directory's own
	}
	var lim syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim) == nil {
		p.sample("process_max_fds", "gauge", "Maximum number of open file descriptors.", "", lim.Cur)
	}
	if vsize, rss, ok := procStatm(); ok {
		p.sample("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", "", vsize)
		p.sample("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", "", rss)
	}
}

// procStatm reads the process's virtual and resident sizes from /proc/self/statm (in pages).
func procStatm() (vsize, rss uint64, ok bool) {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0, 0, false
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0, 0, false
	}
	size, err1 := strconv.ParseUint(f[0], 10, 64)
	resident, err2 := strconv.ParseUint(f[1], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	page := uint64(os.Getpagesize())
	return size * page, resident * page, true
}

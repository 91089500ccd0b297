// procstat.go: CPU time and peak memory of process trees, from /proc.
//
// CPU is counted in clock ticks (USER_HZ, 100 per second on Linux) as utime+stime of every
// live process of a tree plus cutime+cstime (the CPU of children that have already exited and
// been waited for). Taking the same sum before and after a run gives the CPU of everything the
// tree did in between, including workers that came and went.
package main

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// ticksPerSecond is USER_HZ; Linux has used 100 on every architecture Go supports.
const ticksPerSecond = 100

// procStat is the part of /proc/PID/stat that the benchmark needs.
type procStat struct {
	pid, ppid                    int
	utime, stime, cutime, cstime int64
}

// readProcStat parses /proc/PID/stat.
func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(string(b))
}

func parseProcStat(s string) (procStat, error) {
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last ')'.
	end := strings.LastIndexByte(s, ')')
	open := strings.IndexByte(s, '(')
	if end < 0 || open < 0 {
		return procStat{}, fmt.Errorf("malformed stat line %q", s)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(s[:open]))
	if err != nil {
		return procStat{}, fmt.Errorf("malformed stat pid in %q", s)
	}
	f := strings.Fields(s[end+1:])
	if len(f) < 15 {
		return procStat{}, fmt.Errorf("short stat line %q", s)
	}
	num := func(i int) int64 { n, _ := strconv.ParseInt(f[i], 10, 64); return n }
	return procStat{pid: pid, ppid: int(num(1)), utime: num(11), stime: num(12), cutime: num(13), cstime: num(14)}, nil
}

// allProcs reads the stat line of every process.
func allProcs() map[int]procStat {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	out := make(map[int]procStat, len(ents))
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, err := readProcStat(pid); err == nil { // a process may end while we look
			out[pid] = st
		}
	}
	return out
}

// treeCPU is the CPU of one process tree, in ticks.
type treeCPU struct {
	self int64 // the root process's own utime+stime
	rest int64 // its descendants, live and exited
}

func (t treeCPU) total() int64 { return t.self + t.rest }

// cpuOfTree sums the CPU of root and its descendants in procs.
func cpuOfTree(procs map[int]procStat, root int) treeCPU {
	r, ok := procs[root]
	if !ok {
		return treeCPU{}
	}
	children := map[int][]int{}
	for pid, st := range procs {
		children[st.ppid] = append(children[st.ppid], pid)
	}
	t := treeCPU{self: r.utime + r.stime, rest: r.cutime + r.cstime}
	stack := append([]int(nil), children[root]...)
	for n := 0; len(stack) > 0 && n < 100000; n++ {
		pid := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		st := procs[pid]
		t.rest += st.utime + st.stime + st.cutime + st.cstime
		stack = append(stack, children[pid]...)
	}
	return t
}

// peakRSSKiB returns VmHWM (the peak resident set) of pid in KiB, 0 if unknown.
func peakRSSKiB(pid int) int64 {
	return statusField(pid, "VmHWM:")
}

func statusField(pid int, key string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, key); ok {
			fields := strings.Fields(rest)
			if len(fields) > 0 {
				n, _ := strconv.ParseInt(fields[0], 10, 64)
				return n
			}
		}
	}
	return 0
}

// descendants lists the live descendants of root.
func descendants(procs map[int]procStat, root int) []int {
	children := map[int][]int{}
	for pid, st := range procs {
		children[st.ppid] = append(children[st.ppid], pid)
	}
	var out []int
	stack := append([]int(nil), children[root]...)
	for n := 0; len(stack) > 0 && n < 100000; n++ {
		pid := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		out = append(out, pid)
		stack = append(stack, children[pid]...)
	}
	return out
}

// machineInfo describes the machine for the report: CPU model and memory.
func machineInfo() (model string, memMiB int64) {
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" && model == "" {
				model = strings.TrimSpace(v)
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				f := strings.Fields(rest)
				if len(f) > 0 {
					kb, _ := strconv.ParseInt(f[0], 10, 64)
					memMiB = kb / 1024
				}
			}
		}
	}
	return model, memMiB
}

// machineCPU reads the first line of /proc/stat: busy and total ticks of all CPUs.
func machineCPU() (busy, total int64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0
	}
	var v [8]int64
	for i := range v {
		v[i], _ = strconv.ParseInt(f[i+1], 10, 64)
	}
	// user nice system idle iowait irq softirq steal
	busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
	return busy, busy + v[3] + v[4]
}

// Package damon stops and starts the kernel's DAMON (Data Access MONitor) for the
// benchmarks. Some virtual machines, this project's among them, run DAMON with a pageout
// scheme: its kernel thread kdamond takes one of the machine's vCPUs for 25-43 ms at a time
// (perf sched timehist), which on 2 vCPUs puts every process that wakes meanwhile in a queue
// for the other one. That is the machine's noise, not the measured system's, so the
// benchmarks (bench/pipeline, tools/faninbench) stop it while they measure and say so in
// their reports; bench/pipeline/quiet.go has the measurements.
package damon

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// states are the kdamond state files of DAMON's sysfs interface.
const states = "/sys/kernel/mm/damon/admin/kdamonds/*/state"

// Pause stops every running kdamond and returns the state files it stopped, for Set; the
// errors are those it could not stop (not root), which keep running. None: no DAMON.
func Pause() (stopped []string, errs []error) {
	files, _ := filepath.Glob(states)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil || strings.TrimSpace(string(b)) != "on" {
			continue
		}
		if err := os.WriteFile(f, []byte("off"), 0); err != nil {
			errs = append(errs, fmt.Errorf("stop DAMON (%s): %w", f, err))
			continue
		}
		stopped = append(stopped, f)
	}
	return stopped, errs
}

// Set writes state ("on", "off") to the state files Pause stopped.
func Set(files []string, state string) error {
	for _, f := range files {
		if err := os.WriteFile(f, []byte(state), 0); err != nil {
			return fmt.Errorf("set DAMON %s (%s): %w; write %q to it by hand", state, f, err, state)
		}
	}
	return nil
}

// Running reports whether a kdamond is on.
func Running() bool {
	files, _ := filepath.Glob(states)
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) == "on" {
			return true
		}
	}
	return false
}

// CPUTicks is the CPU time (utime + stime, clock ticks) of the kdamond threads so far.
func CPUTicks() int64 {
	ents, _ := os.ReadDir("/proc")
	var ticks int64
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if err != nil || !strings.HasPrefix(string(comm), "kdamond") {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		if t, ok := statTicks(string(stat)); ok {
			ticks += t
		}
	}
	return ticks
}

// statTicks is utime + stime of a /proc/PID/stat line. The command name, field 2, is in
// parentheses and may hold spaces and parentheses itself: the fields are counted from the
// last ")" (state is field 3, utime 14, stime 15).
func statTicks(stat string) (int64, bool) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(stat[i+1:])
	if len(f) < 13 {
		return 0, false
	}
	u, err1 := strconv.ParseInt(f[11], 10, 64)
	s, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return u + s, true
}

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestInheritedDescriptorsNotPassedOn: the daemon's parent (a start-up script, here sh)
// leaves a descriptor open on a file only root may read; the daemon keeps it, but none of its
// workers, which run as USER, gets it. Before, every worker had it open (fd 7 here), and so
// could read the file through it.
func TestInheritedDescriptorsNotPassedOn(t *testing.T) {
	s := newTestSchema(t)
	secret := filepath.Join(testDir(t), "root-only")
	if err := os.WriteFile(secret, []byte("not for workers\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wrap := func(argv ...string) []string {
		return append([]string{"/bin/sh", "-c", `exec 7<"$0" "$@"`, secret}, argv...)
	}
	d := startDaemonWrapped(t, wrap, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
	d.waitLog("dispatching", dbStatementBudget)
	if to, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/7", d.cmd.Process.Pid)); err != nil || to != secret {
		t.Fatalf("the daemon's fd 7: %q, %v; want the file its parent opened (the test's premise)", to, err)
	}
	enqueue(t, s, "a", 1, `{"sleep_ms": 1000}`)
	var workers []int
	waitFor(t, 30*time.Second, "a worker", func() bool { workers = workerPids(t, d); return len(workers) > 0 })
	for _, pid := range workers {
		for fd, to := range fdTargets(t, pid) {
			if to == secret {
				t.Errorf("worker %d has the daemon's inherited descriptor open as its fd %s", pid, fd)
			}
		}
	}
	d.stop()
}

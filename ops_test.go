// ops_test.go: what an operator relies on: hot reload, statistics, the privilege drop and
// /metrics, each against the real daemon.

package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestReloadChangesGraph: a config table change takes effect without a restart: a final stage
// gains a NEXT stage defined only in the table, and every old worker is retired.
func TestReloadChangesGraph(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 2"), "pipeline")
	enqueue(t, s, "a", 20, `{}`)
	waitFor(t, 30*time.Second, "20 done at a", func() bool { return countStatus(t, s, "done") == 20 })
	before := s.count(t, `SELECT count(DISTINCT pid) FROM runs`)
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'NEXT', 'b'), ('stage-b', 'PROGRAM', $1)`, testWorkerBin(t))
	d.waitLog("stage graph reloaded", 30*time.Second)
	enqueue(t, s, "a", 20, `{}`)
	waitFor(t, 30*time.Second, "20 more done at b", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND stage = 'b'`) == 20
	})
	if n := s.count(t, `SELECT count(*) FROM runs r WHERE stage = 'a' AND id > (SELECT min(workqueue_id) + 19 FROM workqueue)
	                     AND pid IN (SELECT pid FROM runs WHERE id <= (SELECT min(workqueue_id) + 19 FROM workqueue))`); n != 0 {
		t.Errorf("%d messages after the reload ran on workers started before it (of %d)", n, before)
	}
	d.stop()
}

// TestReloadRetiresBusyWorkers: a reload while a worker is busy lets its current message
// report, then the rest of its pipeline goes back to pending and runs on a new worker.
func TestReloadRetiresBusyWorkers(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 4"), "pipeline")
	warmUp(t, s, "a")
	s.exec(t, `INSERT INTO workqueue (stage, payload) SELECT 'a', '{"sleep_ms": 300}' FROM generate_series(1, 4)`)
	waitFor(t, 10*time.Second, "4 running", func() bool { return countStatus(t, s, "running") == 4 })
	s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'PARALLELISM', '2')`)
	waitFor(t, 60*time.Second, "all done", func() bool { return countStatus(t, s, "done") == 5 })
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY id HAVING count(*) > 1) x`); bad != 0 {
		t.Errorf("%d messages ran twice across the reload", bad)
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts <> 0`); n != 0 {
		t.Errorf("%d messages charged an attempt by a reload", n)
	}
	d.stop()
}

// TestReloadInvalidGraphExits1: a reloaded graph that does not validate ends the process with
// status 1 and a log line naming the problem; it never routes by a half-applied graph. The
// config table's own check refuses such a row (TestConfigGraphTypoRefusedDaemonRuns), so the
// graph comes from the file here, reloaded on SIGHUP; and from a row written with the check
// off (a table mended by hand, a restore), which the next config_changed reloads.
func TestReloadInvalidGraphExits1(t *testing.T) {
	t.Run("file", func(t *testing.T) {
		s := newTestSchema(t)
		conf := baseConf(s, "") + stageConf(t, "a", "", "")
		d := startDaemon(t, conf, "pipeline")
		d.waitLog("dispatching", 30*time.Second)
		if err := os.WriteFile(d.conf, []byte(strings.Replace(conf, "NEXT = \n", "NEXT = nowhere\n", 1)), 0o644); err != nil {
			t.Fatal(err)
		}
		d.cmd.Process.Signal(syscall.SIGHUP)
		reloadInvalidGraphExits1(t, d)
	})
	t.Run("table", func(t *testing.T) {
		s := newTestSchema(t)
		d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
		d.waitLog("dispatching", 30*time.Second)
		s.exec(t, `ALTER TABLE config DISABLE TRIGGER config_graph`)
		s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'NEXT', 'nowhere')`)
		reloadInvalidGraphExits1(t, d)
	})
}

func reloadInvalidGraphExits1(t *testing.T, d *daemon) {
	t.Helper()
	if st := d.wait(30 * time.Second); st != 1 {
		t.Fatalf("exit %d, want 1", st)
	}
	if !strings.Contains(d.log.String(), `NEXT: names stage \"nowhere\", which is not defined`) {
		t.Errorf("log does not name the problem:\n%s", d.log.String())
	}
}

// TestStatsIdleFlush: a finished burst's figures reach the tables within about a second, not
// at the next STATS_INTERVAL (60 s here), and nothing is written while nothing changes.
func TestStatsIdleFlush(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := baseConf(s, "") + stageConf(t, "a", "b", "") + stageConf(t, "b", "", "")
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", 50, `{}`)
	waitFor(t, 30*time.Second, "50 done", func() bool { return countStatus(t, s, "done") == 50 })
	burstEnd := time.Now()
	waitFor(t, 5*time.Second, "stats flushed", func() bool {
		return s.count(t, `SELECT coalesce(sum(processed), 0) FROM stage_stats`) == 100
	})
	if lag := time.Since(burstEnd); lag > 3*time.Second {
		t.Errorf("idle flush came %v after the burst", lag)
	}
	if n := s.count(t, `SELECT stage_runs FROM dispatch_stats`); n != 100 {
		t.Errorf("dispatch_stats.stage_runs %d, want 100", n)
	}
	if n := s.count(t, `SELECT done FROM dispatch_stats`); n != 50 {
		t.Errorf("dispatch_stats.done %d, want 50 (from the SDK's status lines)", n)
	}
	var stamp string
	s.DB.QueryRow(`SELECT updated_at::text FROM dispatch_stats`).Scan(&stamp)
	// Three heartbeats (POLL_INTERVAL = 1 s) with nothing to do: nothing may be written.
	hb := strings.Count(d.log.String(), `msg=heartbeat`)
	waitFor(t, 10*time.Second, "three idle heartbeats", func() bool {
		return strings.Count(d.log.String(), `msg=heartbeat`) >= hb+3
	})
	var again string
	s.DB.QueryRow(`SELECT updated_at::text FROM dispatch_stats`).Scan(&again)
	if again != stamp {
		t.Errorf("statistics written while idle: %s then %s", stamp, again)
	}
	d.stop()
	if s.count(t, `SELECT (max_ms >= 0 AND busy_ms >= 0 AND workers_started >= 1)::int FROM stage_stats WHERE stage = 'a'`) != 1 {
		t.Error("stage_stats timing columns not filled")
	}
}

// TestPrivilegeDrop: started as root, workers run as USER; a missing USER is refused.
func TestPrivilegeDrop(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the dispatcher drops privileges only when started as root (CI runs as root)")
	}
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline")
	enqueue(t, s, "a", 3, `{}`)
	waitFor(t, 30*time.Second, "3 done", func() bool { return countStatus(t, s, "done") == 3 })
	if uid := s.count(t, `SELECT max(uid) FROM runs`); uid != 65534 {
		t.Errorf("worker ran as uid %d, want nobody (65534)", uid)
	}
	d.stop()

	conf := strings.Replace(baseConf(s, ""), "USER = nobody", "USER = no-such-account-here", 1) + stageConf(t, "a", "", "")
	d2 := startDaemon(t, conf, "pipeline")
	if st := d2.wait(30 * time.Second); st != 2 {
		t.Fatalf("exit %d with a missing USER, want 2", st)
	}
	if !strings.Contains(d2.log.String(), `account "no-such-account-here" does not exist`) || !strings.Contains(d2.log.String(), "refusing to run as root") {
		t.Errorf("refusal not clear:\n%s", d2.log.String())
	}
}

// freePort returns a loopback address that was free a moment ago.
func freePort(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestMetrics(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	conf := baseConf(s, "METRICS_LISTEN = "+addr) + stageConf(t, "a", "", "PARALLELISM = 2")
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", 30, `{}`)
	s.exec(t, `INSERT INTO workqueue (stage) VALUES ('orphan-stage')`)
	waitFor(t, 30*time.Second, "30 done", func() bool { return countStatus(t, s, "done") == 30 })
	var body string
	waitFor(t, 10*time.Second, "metrics with the counters", func() bool {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return strings.Contains(body, `pepsi_stage_processed_total{stage="a"} 30`)
	})
	for _, want := range []string{
		"# TYPE pepsi_stage_processed_total counter", `pepsi_build_info{version="dev"} 1`,
		`pepsi_rows{stage="orphan-stage",status="pending"} 1`, `pepsi_oldest_pending_seconds{stage="orphan-stage"}`,
		"pepsi_stage_workers{stage=\"a\"}", "pepsi_in_flight 0", "pepsi_rows_query_ok 1",
		"pepsi_fanin_open_groups 0", "pepsi_fanin_sweep_repaired_total 0",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q:\n%s", want, body)
		}
	}
	d.stop()
}

// TestMetricsCurlable is the closing note's curl, kept honest: the endpoint answers plain HTTP.
func TestMetricsCurlable(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl not installed")
	}
	s := newTestSchema(t)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", ""), "pipeline")
	d.waitLog("metrics endpoint listening", 30*time.Second)
	out, err := exec.Command("curl", "-sf", "http://"+addr+"/metrics").Output()
	if err != nil || !strings.Contains(string(out), "pepsi_build_info") {
		t.Errorf("curl: %v\n%s", err, out)
	}
	d.stop()
}

// TestSystemdNotify reads the sd_notify datagrams: READY=1 once the lock is held and the
// daemon listens, WATCHDOG=1 pings, STOPPING=1 at shutdown.
func TestSystemdNotify(t *testing.T) {
	s := newTestSchema(t)
	// An abstract socket: the daemon drops to `nobody` and still reaches it.
	name := fmt.Sprintf("@pepsi-test-notify-%d", time.Now().UnixNano())
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: "\x00" + name[1:], Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	got := make(chan string, 100)
	go func() {
		buf := make([]byte, 512)
		for {
			n, _, err := conn.ReadFromUnix(buf)
			if err != nil {
				close(got)
				return
			}
			got <- string(buf[:n])
		}
	}()
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", ""), "pipeline",
		"NOTIFY_SOCKET="+name, "WATCHDOG_USEC=200000")
	expect := func(want string) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case msg := <-got:
				if msg == want {
					return
				}
			case <-deadline:
				t.Fatalf("no %s datagram", want)
			}
		}
	}
	expect("READY=1")
	if !strings.Contains(d.log.String(), "single-instance lock taken") {
		t.Error("READY=1 came before the lock was held")
	}
	expect("WATCHDOG=1")
	expect("WATCHDOG=1")
	d.cmd.Process.Signal(syscall.SIGTERM)
	expect("STOPPING=1")
	if st := d.wait(30 * time.Second); st != 0 {
		t.Fatalf("exit %d", st)
	}
}

// TestRetention: done and cancelled rows that finished long ago go, in batches, when idle;
// every other status, young done rows and old rows that finished recently stay.
func TestRetention(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at)
		SELECT 'zz', st, now() - interval '10 days' FROM unnest(ARRAY['pending','paused','failed']) st`)
	s.exec(t, `UPDATE workqueue SET status_at = created_at`)
	// A parent waiting on an open group of two children, one of them done long ago: its parent
	// still needs it, so retention must leave it (and the fan-in trigger would refuse anyway).
	parent := insertOne(t, s, "zz", `{}`)
	var group int64
	if err := s.DB.QueryRow(`INSERT INTO fanout (parent_id, expected_n) VALUES ($1, 2) RETURNING fanout_id`, parent).Scan(&group); err != nil {
		t.Fatal(err)
	}
	s.exec(t, `UPDATE workqueue SET status = 'waiting', wait_fanout_id = $2, created_at = now() - interval '10 days' WHERE workqueue_id = $1`, parent, group)
	s.exec(t, `INSERT INTO workqueue (stage, status, fanout_id, fanout_seq, created_at)
		SELECT 'zz', st, $1, n, now() - interval '10 days' FROM unnest(ARRAY['done', 'pending']) WITH ORDINALITY AS x(st, n)`, group)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at) SELECT 'zz', 'done', now() - interval '10 days', now() - interval '10 days' FROM generate_series(1, 2500)`)
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at, status_at) SELECT 'zz', 'cancelled', now() - interval '10 days', now() - interval '8 days' FROM generate_series(1, 3)`)
	s.exec(t, `INSERT INTO workqueue (stage, status) SELECT 'zz', 'done' FROM generate_series(1, 7)`)
	// Enqueued long ago, finished just now: RETENTION counts from the end, not the start.
	s.exec(t, `INSERT INTO workqueue (stage, status, created_at) VALUES ('zz', 'done', now() - interval '10 days')`)
	s.exec(t, `UPDATE workqueue SET status_at = created_at WHERE fanout_id IS NOT NULL OR workqueue_id = $1`, parent)
	d := startDaemon(t, baseConf(s, "RETENTION = 7d"), "pipeline")
	waitFor(t, 30*time.Second, "old done rows deleted", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status IN ('done', 'cancelled')`) == 9
	})
	d.waitLog("retention: deleted old done rows", 5*time.Second)
	for st, want := range map[string]int{"pending": 2, "paused": 1, "waiting": 1, "failed": 1} {
		if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = $1`, st); n != want {
			t.Errorf("retention touched a %s row (%d left, want %d)", st, n, want)
		}
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND created_at < now() - interval '9 days' AND fanout_id IS NULL`); n != 1 {
		t.Errorf("retention deleted a row that finished just now (counted from created_at)")
	}
	if n := s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND fanout_id IS NOT NULL`); n != 1 {
		t.Errorf("retention deleted the done child of an open group")
	}
	d.stop()
}

// TestSeveralSystemsOneDatabase: independent systems in one database, each with its own
// schema (search_path in the DSN) and its own dispatcher, run side by side: each moves only
// its own messages, and neither fences nor locks the other.
func TestSeveralSystemsOneDatabase(t *testing.T) {
	s1, s2 := newTestSchema(t), newTestSchema(t)
	s1.exec(t, runsDDL)
	s2.exec(t, runsDDL)
	conf := func(s *testSchema) string {
		return baseConf(s, "") + stageConf(t, "a", "b", "") + stageConf(t, "b", "", "")
	}
	d1 := startDaemon(t, conf(s1), "pipeline")
	d1.waitLog("dispatching", 30*time.Second)
	d2 := startDaemon(t, conf(s2), "pipeline")
	d2.waitLog("fenced_sessions=0", 30*time.Second) // the second start did not fence the first system's workers
	enqueue(t, s1, "a", 300, `{}`)
	enqueue(t, s2, "a", 200, `{}`)
	waitFor(t, 60*time.Second, "both systems done", func() bool {
		return countStatus(t, s1, "done") == 300 && countStatus(t, s2, "done") == 200
	})
	for _, s := range []*testSchema{s1, s2} {
		if bad := s.count(t, `SELECT count(*) FROM (SELECT id, stage FROM runs GROUP BY 1, 2 HAVING count(*) <> 1) x`); bad != 0 {
			t.Errorf("%s: %d (message, stage) pairs ran other than once", s.Name, bad)
		}
	}
	if n := s1.count(t, `SELECT count(*) FROM runs`); n != 600 {
		t.Errorf("system 1 ran %d stages, want 600 (its own messages only)", n)
	}
	// Restarting one system's dispatcher fences only its own workers.
	d2.stop()
	d2b := startDaemon(t, conf(s2), "pipeline")
	d2b.waitLog("dispatching", 30*time.Second)
	enqueue(t, s1, "a", 100, `{}`)
	waitFor(t, 60*time.Second, "system 1 still moving", func() bool { return countStatus(t, s1, "done") == 400 })
	d2b.stop()
	d1.stop()
}

// TestDaemonProcessors: the daemon runs on one processor unless GOMAXPROCS says otherwise
// (main.go, oneProc), and its start-up line says how many it has.
func TestDaemonProcessors(t *testing.T) {
	for _, tc := range []struct{ env, want string }{
		{"GOMAXPROCS=", "procs=1"}, // unset: Go ignores an empty value, and so does oneProc
		{"GOMAXPROCS=2", "procs=2"},
	} {
		t.Run(tc.env, func(t *testing.T) {
			conf := fmt.Sprintf("[poolcounter]\nLISTEN = %s\n[pepsi-dispatch]\nUSER = nobody\n", freePort(t))
			d := startDaemon(t, conf, "", tc.env)
			d.waitLog("lock service listening", 30*time.Second)
			var line string
			for _, l := range strings.Split(d.log.String(), "\n") {
				if strings.Contains(l, "pepsi-dispatch starting") {
					line = l
				}
			}
			if !strings.Contains(line, " "+tc.want) {
				t.Errorf("with %s the start-up line is %q, want %s", tc.env, line, tc.want)
			}
			d.stop()
		})
	}
}

// TestLockServiceAlone: a configuration with only [poolcounter] runs the lock service by
// itself (a drop-in for poolcounterd), with its counters on /metrics, and stops cleanly.
func TestLockServiceAlone(t *testing.T) {
	addr, maddr := freePort(t), freePort(t)
	conf := fmt.Sprintf("[poolcounter]\nLISTEN = %s\n[pepsi-dispatch]\nUSER = nobody\nMETRICS_LISTEN = %s\n", addr, maddr)
	d := startDaemon(t, conf, "")
	d.waitLog("lock service listening", 30*time.Second)
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(conn)
	for _, step := range [][2]string{{"ACQ4ME k 1 1 1\n", "LOCKED\n"}, {"RELEASE\n", "RELEASED\n"}} {
		io.WriteString(conn, step[0])
		if got, err := r.ReadString('\n'); err != nil || got != step[1] {
			t.Fatalf("%q: got %q, %v; want %q", step[0], got, err, step[1])
		}
	}
	resp, err := http.Get("http://" + maddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "pepsi_poolcounter_") {
		t.Errorf("no lock counters on /metrics:\n%s", body)
	}
	d.stop()
	if strings.Contains(d.log.String(), "component=poolcounter component=poolcounter") {
		t.Error("component attribute logged twice")
	}
}

// TestFaninPinnedToItsSchema: a child finished by a session whose search_path names another
// system still records its evidence in its own system's inbox (the functions are pinned).
func TestFaninPinnedToItsSchema(t *testing.T) {
	s1, s2 := newTestSchema(t), newTestSchema(t)
	parent := insertOne(t, s1, "split", `{}`)
	s1.exec(t, `UPDATE workqueue SET status = 'running' WHERE workqueue_id = $1`, parent)
	s1.exec(t, `SELECT fanout_split($1, 'split', 'join', 'child', '[{}]'::jsonb)`, parent)
	child := s1.count(t, `SELECT workqueue_id FROM workqueue WHERE fanout_id IS NOT NULL`)
	// s2's connection, s1's table by its qualified name.
	s2.exec(t, `UPDATE `+s1.Name+`.workqueue SET status = 'done' WHERE workqueue_id = $1`, child)
	if n := s1.count(t, `SELECT count(*) FROM fanin_event`); n != 1 {
		t.Errorf("%d events in the child's own system, want 1", n)
	}
	if n := s2.count(t, `SELECT count(*) FROM fanin_event`); n != 0 {
		t.Errorf("%d events leaked into another system's inbox", n)
	}
}

// TestSighupReloadsFile: SIGHUP re-reads the file's [stage-*] sections, like config_changed.
func TestSighupReloadsFile(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	dir := testDir(t)
	path := writeFile(t, dir, "pepsi.conf", baseConf(s, "")+stageConf(t, "a", "", ""))
	cmd := exec.Command(os.Args[0], "-c", path, "-v", "serve")
	cmd.Env = append(os.Environ(), "PEPSI_TEST_DAEMON=1", "PEPSI_TEST_WORKER=pipeline")
	d := &daemon{t: t, cmd: cmd, log: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = d.log, d.log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { cmd.Wait(); close(d.done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-d.done })
	d.waitLog("dispatching", 30*time.Second)
	writeFile(t, dir, "pepsi.conf", baseConf(s, "")+stageConf(t, "a", "b", "")+stageConf(t, "b", "", ""))
	cmd.Process.Signal(syscall.SIGHUP)
	d.waitLog("stage graph reloaded", 30*time.Second)
	enqueue(t, s, "a", 5, `{}`)
	waitFor(t, 30*time.Second, "5 done at b", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'done' AND stage = 'b'`) == 5
	})
	cmd.Process.Signal(syscall.SIGTERM)
	<-d.done
	if cmd.ProcessState.ExitCode() != 0 {
		t.Errorf("exit %d", cmd.ProcessState.ExitCode())
	}
}

// TestInstall: `make build` and `make install` (PREFIX, DESTDIR) lay out the static binary,
// the man pages, the shared files, the unit and the sysusers entry; the installed binary
// reports the version it was built with in its start-up log line.
func TestInstall(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not installed")
	}
	root := testDir(t)
	if out, err := exec.Command("make", "-s", "build", "VERSION=9.8.7-test").CombinedOutput(); err != nil {
		t.Fatalf("make build: %v\n%s", err, out)
	}
	if out, err := exec.Command("make", "-s", "install", "DESTDIR="+root, "PREFIX=/usr").CombinedOutput(); err != nil {
		t.Fatalf("make install: %v\n%s", err, out)
	}
	for _, f := range []string{
		"usr/bin/pepsi-dispatch", "usr/share/man/man1/pepsi-dispatch.1", "usr/share/man/man5/pepsi.conf.5",
		"usr/share/man/man7/pepsi-worker.7", "usr/share/pepsi/schema.sql", "usr/share/pepsi/pepsi.conf.example",
		"lib/systemd/system/pepsi-dispatch.service", "usr/lib/sysusers.d/pepsi.conf",
		"usr/bin/pepsi-queue", "usr/share/man/man1/pepsi-queue.1", "usr/share/pepsi/operate.sql",
	} {
		if _, err := os.Stat(root + "/" + f); err != nil {
			t.Errorf("not installed: %s", f)
		}
	}
	unit, _ := os.ReadFile(root + "/lib/systemd/system/pepsi-dispatch.service")
	if !strings.Contains(string(unit), "ExecStart=/usr/bin/pepsi-dispatch") || !strings.Contains(string(unit), "Type=notify") {
		t.Errorf("unit does not start the installed binary under Type=notify:\n%s", unit)
	}
	// The installed binary runs, and says which version it is.
	conf := writeFile(t, testDir(t), "c.conf", fmt.Sprintf("[poolcounter]\nLISTEN = %s\n[pepsi-dispatch]\nUSER = nobody\n", freePort(t)))
	cmd := exec.Command(root+"/usr/bin/pepsi-dispatch", "-c", conf, "serve")
	log := &syncBuffer{}
	cmd.Stderr = log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "start-up log line", func() bool { return strings.Contains(log.String(), "lock service listening") })
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Errorf("installed binary: %v\n%s", err, log.String())
	}
	if !strings.Contains(log.String(), "version=9.8.7-test") {
		t.Errorf("start-up log does not report the build version:\n%s", log.String())
	}
	if out, err := exec.Command("make", "-s", "uninstall", "DESTDIR="+root, "PREFIX=/usr").CombinedOutput(); err != nil {
		t.Errorf("make uninstall: %v\n%s", err, out)
	}
	for _, f := range []string{"usr/bin/pepsi-dispatch", "usr/bin/pepsi-queue", "usr/share/pepsi/operate.sql"} {
		if _, err := os.Stat(root + "/" + f); err == nil {
			t.Errorf("uninstall left %s", f)
		}
	}
}

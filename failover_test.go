// failover_test.go: losing a machine. A primary with a synchronous standby (two private
// clusters of scripts/pg-private) failed over mid-run, a start against standbys only, a
// standby dispatcher that takes over from a SIGKILLed one and fences a frozen one, and the
// SIGTERM grace that must not charge a hung message. Real processes and real servers only.

package main

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"pepsi-dispatch/internal/pgtest"
	"pepsi-dispatch/internal/schemafile"

	"github.com/lib/pq"
)

// pgPair is a primary and its synchronous standby, two private clusters of one test (or the
// primary alone: nodes = 1). The roles swap at each failover: node[primary] is the primary.
type pgPair struct {
	t       testing.TB
	script  string
	nodes   int
	env     []string // added to pg-private's environment, and so to the servers'
	dirs    [2]string
	ports   [2]string
	primary int
}

// newPGPair starts a primary and a synchronous standby (pg_basebackup -R) for t; both are
// stopped and removed when t ends.
func newPGPair(t *testing.T) *pgPair {
	t.Helper()
	if testing.Short() {
		t.Skip("starts two PostgreSQL clusters")
	}
	return newPGNodes(t, 2, "pepsi-test-pair-")
}

// newPGNodes starts a primary and, with nodes = 2, its synchronous standby, in a temporary
// directory named from prefix, with env added to their environment; they are stopped and
// removed when t ends.
func newPGNodes(t *testing.T, nodes int, prefix string, env ...string) *pgPair {
	t.Helper()
	root, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	return newPGNodesIn(t, root, nodes, env...)
}

// newPGNodesIn is newPGNodes in the directory root, which it empties at the end.
func newPGNodesIn(t *testing.T, root string, nodes int, env ...string) *pgPair {
	t.Helper()
	os.Chmod(root, 0o755) // the clusters run as another account when the tests run as root
	p := &pgPair{t: t, script: filepath.Join(testPG.Root(), "scripts/pg-private"), nodes: nodes, env: env}
	p.dirs = [2]string{filepath.Join(root, "n0"), filepath.Join(root, "n1")}
	t.Cleanup(func() {
		for _, d := range p.dirs[:p.nodes] {
			exec.Command(p.script, "stop", d).Run() // best effort: the directory goes anyway
		}
		os.RemoveAll(root)
	})
	p.run("start", p.dirs[0])
	if nodes == 2 {
		p.run("standby", p.dirs[1], p.dirs[0])
	}
	for i, d := range p.dirs[:nodes] {
		b, err := os.ReadFile(filepath.Join(d, "port"))
		if err != nil {
			t.Fatal(err)
		}
		p.ports[i] = strings.TrimSpace(string(b))
	}
	return p
}

func (p *pgPair) run(args ...string) {
	p.t.Helper()
	start := time.Now()
	cmd := exec.Command(p.script, args...)
	if p.env != nil {
		cmd.Env = append(os.Environ(), p.env...)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		p.t.Fatalf("pg-private %v: %v\n%s", args, err, out)
	}
	p.t.Logf("pg-private %s %s: %v", args[0], filepath.Base(args[1]), time.Since(start).Round(time.Millisecond))
}

// dsn lists the nodes in the given order (node indexes), with extra parameters appended.
func (p *pgPair) dsn(order []int, extra string) string {
	var hosts, ports []string
	for _, i := range order {
		hosts, ports = append(hosts, p.dirs[i]), append(ports, p.ports[i])
	}
	return fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres sslmode=disable %s",
		strings.Join(hosts, ","), strings.Join(ports, ","), extra)
}

// nodeDB opens one node alone (for looking at a standby).
func (p *pgPair) nodeDB(i int) *sql.DB {
	db, err := sql.Open("postgres", fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres sslmode=disable", p.dirs[i], p.ports[i]))
	if err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(func() { db.Close() })
	return db
}

// schema creates a fresh schema with schema.sql on the primary. Its DB follows the primary
// (target_session_attrs=read-write) and keeps no idle connection, so no query of the test
// meets a connection that a failover cut.
func (p *pgPair) schema(t *testing.T) *testSchema {
	t.Helper()
	name := fmt.Sprintf("ha_%d", time.Now().UnixNano()%1e9)
	admin := p.nodeDB(p.primary)
	pgtest.Exec(t, admin, "CREATE SCHEMA "+name)
	ddl, err := schemafile.Read(filepath.Join(testPG.Root(), "schema.sql")) // with its \ir includes
	if err != nil {
		t.Fatal(err)
	}
	opts := fmt.Sprintf("options='-c search_path=%s'", name)
	order := []int{0, 1}[:p.nodes]
	dsn := p.dsn(order, "target_session_attrs=read-write "+opts)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0)
	t.Cleanup(func() { db.Close() })
	pgtest.Exec(t, db, ddl)
	return &testSchema{Name: name, DSN: dsn, DB: db}
}

// killPrimary stops the primary at once, as a crash would.
func (p *pgPair) killPrimary() { p.t.Helper(); p.run("kill", p.dirs[p.primary]) }

// promote promotes the standby: it becomes the primary, alone.
func (p *pgPair) promote() {
	p.t.Helper()
	p.primary = 1 - p.primary
	p.run("promote", p.dirs[p.primary])
}

// rebuildStandby makes the old primary a synchronous standby of the new one again.
func (p *pgPair) rebuildStandby() {
	p.t.Helper()
	p.run("standby", p.dirs[1-p.primary], p.dirs[p.primary])
}

// advisoryLocks counts pepsi's single-instance locks held on node i.
func (p *pgPair) advisoryLocks(i int) int {
	var n int
	err := p.nodeDB(i).QueryRow(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1 AND granted`,
		lockClass).Scan(&n)
	if err != nil {
		return -1
	}
	return n
}

// poll is a count that tolerates the moments when no primary answers: -1 then.
func poll(s *testSchema, query string, args ...any) int {
	var n int
	if err := s.DB.QueryRow(query, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// TestFailoverMidRun: the primary is stopped at once mid-run and the standby promoted after
// 0.5 s, 15 s, then 0.5 s again, under one dispatcher that is never restarted. Every message
// ends done, each (message, stage) is committed once (the stage logs its run in the
// transaction of its outcome), no row is left running, and no attempt is charged.
func TestFailoverMidRun(t *testing.T) {
	p := newPGPair(t)
	s := p.schema(t)
	s.exec(t, runsDDL)
	const batch = 150
	d := startDaemon(t, threeStages(t, s), "pipeline")
	d.waitLog("dispatching", 60*time.Second)
	delays := []time.Duration{500 * time.Millisecond, 15 * time.Second, 500 * time.Millisecond}
	for i, delay := range delays {
		enqueue(t, s, "a", batch, `{"sleep_ms": 20}`)
		want := i*batch + batch/10
		waitFor(t, 120*time.Second, "the batch under way", func() bool { return poll(s, `SELECT count(*) FROM runs`) >= want })
		p.killPrimary()
		// The outage itself: how long no server accepts writes is what this loop varies.
		time.Sleep(delay)
		start := time.Now()
		p.promote()
		promoted := time.Now() // the new primary accepts connections by now
		waitFor(t, 30*time.Second, "LISTEN back on the new primary", func() bool {
			return strings.Count(d.log.String(), "LISTEN connection back") >= i+1
		})
		if late := time.Since(promoted); late > time.Second {
			t.Errorf("failover %d: notifications back %v after the new primary accepted connections, want within 1 s", i+1, late)
		}
		waitFor(t, 60*time.Second, "the lock re-taken on the new primary", func() bool {
			return strings.Count(d.log.String(), "single-instance lock taken again") >= i+1
		})
		t.Logf("failover %d (outage %v): lock re-taken %v after the promotion began (pg_ctl promote -w took part of it)",
			i+1, delay, time.Since(start).Round(time.Millisecond))
		p.rebuildStandby()
	}
	n := len(delays) * batch
	waitFor(t, 180*time.Second, "every message done", func() bool { return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == n })
	checkExactlyOnce(t, s, n)
	if r := countStatus(t, s, "running"); r != 0 {
		t.Errorf("%d rows left running", r)
	}
	checkRodeOut(t, s, d, "the failovers")
	var reconciles []string
	for _, l := range strings.Split(d.log.String(), "\n") {
		if strings.Contains(l, "reconciled the table with memory") || strings.Contains(l, "no attempt charged") {
			reconciles = append(reconciles, l)
		}
	}
	if len(reconciles) == 0 {
		t.Errorf("no reconcile logged")
	}
	t.Logf("reconciles and outage retries:\n%s", strings.Join(reconciles, "\n"))
	d.stop()
}

// TestFailoverStartOnStandby: the standby is first in the DSN, with and without
// target_session_attrs=read-write, while no host accepts writes (the primary is down): the
// dispatcher waits, saying why, and never takes its lock on the standby; once the standby is
// promoted it takes the lock there and runs.
func TestFailoverStartOnStandby(t *testing.T) {
	p := newPGPair(t)
	for _, attrs := range []string{"target_session_attrs=read-write", ""} {
		name := "with read-write"
		if attrs == "" {
			name = "without attributes"
		}
		t.Run(name, func(t *testing.T) {
			s := p.schema(t)
			s.exec(t, runsDDL)
			enqueue(t, s, "a", 20, `{}`)
			p.killPrimary()
			standby := 1 - p.primary
			dsn := p.dsn([]int{standby, p.primary}, attrs+" options='-c search_path="+s.Name+"'")
			conf := strings.Replace(baseConf(s, ""), s.DSN, dsn, 1) + stageConf(t, "a", "", "")
			d := startDaemon(t, conf, "pipeline")
			d.waitLog("no writable database server yet; waiting for one", 60*time.Second)
			start := time.Now()
			waitFor(t, 30*time.Second, "3 s of waiting without a lock on the standby", func() bool {
				if n := p.advisoryLocks(standby); n != 0 {
					t.Fatalf("%d single-instance locks on the standby", n)
				}
				return time.Since(start) > 3*time.Second
			})
			select {
			case <-d.done:
				t.Fatalf("exited with %d while waiting for a primary", d.status)
			default:
			}
			// The lock statement itself refuses a standby, whatever the DSN says.
			conn, err := p.nodeDB(standby).Conn(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := takeLock(context.Background(), conn, 1, false); !errors.Is(err, errReadOnly) {
				t.Errorf("takeLock on the standby: %v, want errReadOnly", err)
			}
			conn.Close()
			if n := p.advisoryLocks(standby); n != 0 {
				t.Fatalf("%d single-instance locks on the standby after takeLock", n)
			}
			p.promote()
			waitFor(t, 60*time.Second, "all done on the promoted standby", func() bool {
				return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == 20
			})
			if n := p.advisoryLocks(p.primary); n != 1 {
				t.Errorf("%d single-instance locks on the new primary, want 1", n)
			}
			checkRunsOnce(t, s, 20)
			d.stop()
			p.rebuildStandby()
		})
	}
}

// checkRodeOut: no message was charged an attempt for event (an outage, a crash of the
// server), and the dispatcher, never restarted, still runs.
func checkRodeOut(t *testing.T, s *testSchema, d *daemon, event string) {
	t.Helper()
	if c := s.count(t, `SELECT count(*) FROM workqueue WHERE attempts <> 0`); c != 0 {
		t.Errorf("%d messages were charged an attempt for %s", c, event)
	}
	select {
	case <-d.done:
		t.Fatalf("the dispatcher exited (status %d); it must ride %s out", d.status, event)
	default:
	}
}

// checkRunsOnce: each of n messages of a one-stage pipeline ran exactly once.
func checkRunsOnce(t *testing.T, s *testSchema, n int) {
	t.Helper()
	if bad := s.count(t, `SELECT count(*) FROM (SELECT id FROM runs GROUP BY id HAVING count(*) <> 1) x`); bad != 0 {
		t.Errorf("%d messages ran other than once", bad)
	}
	if runs := s.count(t, `SELECT count(DISTINCT id) FROM runs`); runs != n {
		t.Errorf("%d messages ran, want %d", runs, n)
	}
}

// scrape returns the /metrics body at addr, "" while it does not answer.
func scrape(addr string) string {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// takeoverBound is the documented bound (doc/high-availability.md) for a standby to take over
// from a holder whose process died on a live machine: the server sees the socket close, the
// standby's lock wait returns, the fence finds the dead holder's workers gone.
const takeoverBound = 5 * time.Second

// TestStandbyTakesOverAfterSigkill: with STANDBY = yes a second serve waits (log, /metrics),
// and takes over within the bound when the first is SIGKILLed; nothing is lost or run twice.
func TestStandbyTakesOverAfterSigkill(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	const n = 600
	conf := strings.Replace(threeStages(t, s), "SHUTDOWN_GRACE = 5", "SHUTDOWN_GRACE = 5\nSTANDBY = yes", 1)
	first := startDaemon(t, conf, "pipeline")
	first.waitLog("single-instance lock taken", 30*time.Second)
	addr := freePort(t)
	second := startDaemon(t, strings.Replace(conf, "STANDBY = yes", "STANDBY = yes\nMETRICS_LISTEN = "+addr, 1), "pipeline")
	second.waitLog("standby: another dispatcher holds the single-instance lock; waiting for it", 30*time.Second)
	waitFor(t, 10*time.Second, "standby role in /metrics", func() bool {
		return strings.Contains(scrape(addr), `pepsi_lock_role{role="standby"} 1`)
	})
	if !strings.Contains(second.log.String(), fmt.Sprintf("pid %d", first.cmd.Process.Pid)) {
		t.Errorf("the standby's log does not name the holder (pid %d)", first.cmd.Process.Pid)
	}
	enqueue(t, s, "a", n, `{"sleep_ms": 2}`)
	waitFor(t, 60*time.Second, "some progress", func() bool { return countStatus(t, s, "done") > n/5 })
	start := time.Now()
	first.cmd.Process.Signal(syscall.SIGKILL)
	second.waitLog("took over the single-instance lock", 30*time.Second)
	took := time.Since(start)
	t.Logf("takeover after SIGKILL: %v", took.Round(time.Millisecond))
	if took > takeoverBound {
		t.Errorf("takeover took %v, documented bound %v", took, takeoverBound)
	}
	waitFor(t, 120*time.Second, "all done after the takeover", func() bool { return countStatus(t, s, "done") == n })
	checkExactlyOnce(t, s, n)
	body := scrape(addr)
	for _, want := range []string{`pepsi_lock_role{role="active"} 1`, `pepsi_lock_role{role="standby"} 0`,
		"pepsi_database_server_info{server=", "pepsi_takeovers_total 1"} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q:\n%s", want, body)
		}
	}
	second.stop()
}

// fenceWorker is a stage that reconnects (database/sql does) and so, thawed after its
// dispatcher lost the system, would commit if nothing stopped it. Each message: a row in
// began (the message is in hand), sleep payload.sleep_ms, then one transaction with the run and the guarded outcome, then a row in
// tries (outside that transaction) saying whether it committed.
func fenceWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		return 2
	}
	defer db.Close()
	st := os.Getenv("PEPSI_STAGE")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		id, _ := strconv.ParseInt(in.Text(), 10, 64)
		var payload []byte
		if err := db.QueryRow(`SELECT coalesce(payload, '{}') FROM workqueue WHERE workqueue_id = $1`, id).Scan(&payload); err != nil {
			fmt.Printf("1 load: %v\n", err)
			continue
		}
		var b struct {
			SleepMs int `json:"sleep_ms"`
		}
		json.Unmarshal(payload, &b)
		if _, err := db.Exec(`INSERT INTO began (id, pid) VALUES ($1, $2)`, id, os.Getpid()); err != nil {
			fmt.Printf("1 began: %v\n", err)
			continue
		}
		time.Sleep(time.Duration(b.SleepMs) * time.Millisecond)
		err := func() error {
			tx, err := db.Begin()
			if err != nil {
				return err
			}
			defer tx.Rollback() // after a Commit, a no-op
			if _, err := tx.Exec(`INSERT INTO runs (id, stage, pid) VALUES ($1, $2, $3)`, id, st, os.Getpid()); err != nil {
				return err
			}
			res, err := tx.Exec(`UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1 AND status = 'running' AND stage = $2`, id, st)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n != 1 {
				return fmt.Errorf("claim gone")
			}
			return tx.Commit()
		}()
		db.Exec(`INSERT INTO tries (id, pid, ok, err) VALUES ($1, $2, $3, $4)`, id, os.Getpid(), err == nil, fmt.Sprint(err))
		if err != nil {
			fmt.Printf("1 %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
			continue
		}
		fmt.Println("0")
	}
	return 0
}

func init() { testWorkers["fence"] = fenceWorker }

// TestStandbyFencesFrozenHolder: the active dispatcher and its workers are frozen (SIGSTOP)
// mid-message, their sessions ended from the server; the standby takes over and claims the
// same messages again. Thawed, the old workers try to commit (onto rows the new dispatcher has
// claimed at the same stage) and are refused; the old dispatcher finds out it lost the lock
// and exits 1. Each message runs once, by the new dispatcher's workers.
func TestStandbyFencesFrozenHolder(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	s.exec(t, `CREATE TABLE tries (id bigint, pid int, ok bool, err text)`)
	s.exec(t, `CREATE TABLE began (id bigint, pid int)`)
	key := int32(uint32(s.count(t, `SELECT to_regclass('workqueue')::oid::bigint`))) // as systemKey folds it
	extra := "STANDBY = yes\nMAX_RUNTIME = 60"
	stage := stageConf(t, "a", "", "PARALLELISM = 2\nQUEUE_LIMIT = 1")
	first := startDaemon(t, baseConf(s, extra)+stage, "fence")
	first.waitLog("single-instance lock taken", 30*time.Second)
	// The standby connects over TCP, the first over the Unix socket: that is how the test
	// tells their sessions apart on the server.
	// With PEPSI_TEST_DSN there is no private cluster's directory (Dir is ""), and replacing
	// "host=" alone made a host name of the socket's path: the standby never connected.
	tcp := strings.Replace(s.DSN, "host="+testPG.Dir(), "host=127.0.0.1", 1)
	if testPG.Dir() == "" || tcp == s.DSN {
		t.Skip("PEPSI_TEST_DSN is not the private cluster's socket DSN")
	}
	second := startDaemon(t, strings.Replace(baseConf(s, extra), s.DSN, tcp, 1)+stage, "fence")
	second.waitLog("standby: another dispatcher holds the single-instance lock", 30*time.Second)

	insertOne(t, s, "a", `{"sleep_ms": 3000}`)
	insertOne(t, s, "a", `{"sleep_ms": 3000}`)
	// A message is running from its claim, before its worker is started or has read it (CI
	// froze the dispatcher in that gap: one worker, or none, to freeze): wait until each is in
	// the hands of a worker of its own, then freeze those.
	waitFor(t, 30*time.Second, "both messages in the hands of the first's two workers", func() bool {
		return s.count(t, `SELECT count(DISTINCT pid) FROM began`) == 2
	})
	oldClaims := s.count(t, `SELECT max(claim) FROM workqueue`)
	var old []int
	for _, f := range strings.Split(s.count0(t, `SELECT string_agg(DISTINCT pid::text, ' ') FROM began`), " ") {
		pid, _ := strconv.Atoi(f)
		old = append(old, pid)
	}
	children := workerPids(t, first)
	for _, pid := range old {
		if !slices.Contains(children, pid) {
			t.Fatalf("the workers holding the messages, %v, are not the first dispatcher's (%v)", old, children)
		}
	}
	signalAll := func(sig syscall.Signal, pids ...int) {
		for _, pid := range pids {
			syscall.Kill(-pid, sig) // each worker leads its own process group
		}
	}
	first.cmd.Process.Signal(syscall.SIGSTOP)
	signalAll(syscall.SIGSTOP, old...)
	defer signalAll(syscall.SIGCONT, old...)
	defer first.cmd.Process.Signal(syscall.SIGCONT)
	killed := s.count(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE client_addr IS NULL AND application_name LIKE 'pepsi-% ' || $1::text || '%'`, strconv.Itoa(int(key)))
	t.Logf("terminated %d sessions of the frozen dispatcher", killed)
	second.waitLog("took over the single-instance lock", 30*time.Second)
	waitFor(t, 30*time.Second, "both messages claimed again by the second", func() bool {
		return s.count(t, `SELECT count(*) FROM workqueue WHERE status = 'running' AND claim > $1`, oldClaims) == 2
	})
	signalAll(syscall.SIGCONT, old...)
	waitFor(t, 30*time.Second, "the old workers' attempts to commit", func() bool {
		return s.count(t, `SELECT count(*) FROM tries WHERE pid = ANY ($1)`, intArray(old)) == 2
	})
	if n := s.count(t, `SELECT count(*) FROM tries WHERE pid = ANY ($1) AND ok`, intArray(old)); n != 0 {
		t.Errorf("%d commits by the frozen dispatcher's workers after the takeover", n)
	}
	if !strings.Contains(s.count0(t, `SELECT string_agg(err, ' | ') FROM tries WHERE pid = ANY ($1)`, intArray(old)), "pepsi fence") {
		t.Errorf("the old workers were not refused by the fence: %s", s.count0(t, `SELECT string_agg(ok::text || ' ' || err, ' | ') FROM tries`))
	}
	first.cmd.Process.Signal(syscall.SIGCONT)
	if st := first.wait(60 * time.Second); st != 1 {
		t.Errorf("the thawed dispatcher exited with %d, want 1", st)
	}
	if !strings.Contains(first.log.String(), "single-instance lock lost") {
		t.Errorf("the thawed dispatcher does not say it lost the lock")
	}
	waitFor(t, 60*time.Second, "both done by the second", func() bool { return countStatus(t, s, "done") == 2 })
	checkRunsOnce(t, s, 2)
	if n := s.count(t, `SELECT count(*) FROM runs WHERE pid = ANY ($1)`, intArray(old)); n != 0 {
		t.Errorf("%d runs committed by the frozen dispatcher's workers", n)
	}
	second.stop()
}

// intArray is a PostgreSQL int[] literal of pids.
func intArray(pids []int) string {
	s := make([]string, len(pids))
	for i, p := range pids {
		s[i] = strconv.Itoa(p)
	}
	return "{" + strings.Join(s, ",") + "}"
}

// count0 runs a query returning one text (NULL as "").
func (s *testSchema) count0(t testing.TB, query string, args ...any) string {
	t.Helper()
	var v sql.NullString
	if err := s.DB.QueryRow(query, args...).Scan(&v); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return v.String
}

// TestSigtermHungPastMaxRuntime: a message that hangs past MAX_RUNTIME during the SIGTERM
// grace is put back to pending, attempts unchanged: a stop is not a failure of the message.
func TestSigtermHungPastMaxRuntime(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(baseConf(s, "MAX_RUNTIME = 2"), "SHUTDOWN_GRACE = 5", "SHUTDOWN_GRACE = 20", 1)
	d := startDaemon(t, conf+stageConf(t, "a", "", "PARALLELISM = 1"), "pipeline")
	warmUp(t, s, "a")
	id := insertOne(t, s, "a", `{"hang_at": "a"}`)
	waitFor(t, 30*time.Second, "the hanging message running", func() bool { return row(t, s, id).status == "running" })
	d.cmd.Process.Signal(syscall.SIGTERM)
	d.waitLog("message ran past MAX_RUNTIME", 30*time.Second)
	if st := d.wait(30 * time.Second); st != 0 {
		t.Fatalf("exit %d after SIGTERM, want 0", st)
	}
	r := row(t, s, id)
	if r.status != "pending" || r.attempts != 0 || r.reason != "" {
		t.Errorf("hung message after the grace: %+v, want pending with no attempt and no error", r)
	}
}

// TestReconcileAfterRelock: a row left running by a claim whose reply the dispatcher never
// saw (the claim committed as the connection broke) is put back to pending by the reconcile
// that follows the re-lock, and runs; the reconcile's counts reach the log and /metrics.
func TestReconcileAfterRelock(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	addr := freePort(t)
	d := startDaemon(t, baseConf(s, "METRICS_LISTEN = "+addr)+stageConf(t, "a", "", ""), "pipeline")
	warmUp(t, s, "a")
	// What the lost reply leaves behind: running under a claim token the dispatcher never
	// learnt. It is not in any worker's queue, so nothing would ever finish it.
	// (Inserted paused far in the future, so that the dispatcher does not claim it first.)
	var id int64
	if err := s.DB.QueryRow(`INSERT INTO workqueue (stage, status, retry_at) VALUES ('a', 'paused', now() + interval '1 day')
		RETURNING workqueue_id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	s.exec(t, `UPDATE workqueue SET status = 'running', retry_at = NULL, claim = nextval('workqueue_claim_seq'), claimed_at = now()
		WHERE workqueue_id = $1`, id)
	// The dispatcher loses its lock connection (as in a failover) and takes the lock again.
	s.exec(t, `SELECT pg_terminate_backend(l.pid) FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objid = to_regclass('workqueue')::oid::bigint`, lockClass)
	d.waitLog("single-instance lock taken again", 60*time.Second)
	d.waitLog("reconciled the table with memory", 10*time.Second)
	if !strings.Contains(d.log.String(), "running_reset=1 ") {
		t.Errorf("the reconcile did not reset the one running row nobody held")
	}
	waitFor(t, 30*time.Second, "the orphan done", func() bool { return row(t, s, id).status == "done" })
	if r := row(t, s, id); r.attempts != 0 {
		t.Errorf("orphan charged %d attempts", r.attempts)
	}
	waitFor(t, 10*time.Second, "reconcile counts in /metrics", func() bool {
		b := scrape(addr)
		return strings.Contains(b, "pepsi_reconciles_total 1") && strings.Contains(b, "pepsi_reconcile_reset_total 1") &&
			strings.Contains(b, `pepsi_lock_role{role="active"} 1`)
	})
	d.stop()
}

// TestFenceRefusesAnotherEpoch: schema.sql's pepsi_fence refuses writes from a worker or a
// dispatcher pool of another epoch than dispatch_instance's, and nobody else's.
func TestFenceRefusesAnotherEpoch(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, `UPDATE dispatch_instance SET epoch = 5`)
	id := insertOne(t, s, "a", `{}`)
	for _, c := range []struct {
		app     string
		refused bool
	}{
		{"pepsi-worker 77 4", true}, {"pepsi-dispatch 77 4", true}, {"pepsi-worker -77 6", true},
		{"pepsi-worker 77 5", false}, {"pepsi-dispatch 77 5", false},
		{"pepsi-dispatch 77", false}, {"pepsi-worker 77", false}, {"psql", false},
	} {
		conn, err := s.DB.Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.ExecContext(context.Background(), `SELECT set_config('application_name', $1, false)`, c.app); err != nil {
			t.Fatal(err)
		}
		for _, q := range []string{
			`UPDATE workqueue SET payload = '{}' WHERE workqueue_id = ` + strconv.FormatInt(id, 10),
			`INSERT INTO workqueue (stage) VALUES ('a')`,
			`UPDATE dispatch_stats SET claims = claims`,
			`UPDATE stage_stats SET processed = processed`,
		} {
			_, err := conn.ExecContext(context.Background(), q)
			var pe *pq.Error
			refused := errors.As(err, &pe) && pe.Code == "PD001"
			if refused != c.refused || (err != nil && !refused) {
				t.Errorf("%s: %s: %v, want refused=%v", c.app, q, err, c.refused)
			}
		}
		conn.Close()
	}
}

// refusedWorker fails every message with words that an outage of the database also uses.
func refusedWorker() int {
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		fmt.Println("1 post to the mail relay: dial tcp 10.0.0.1:25: connect: connection refused")
	}
	return 0
}

func init() { testWorkers["refused"] = refusedWorker }

// TestOutageWordsWithoutOutage: a stage failing with "connection refused" while the
// dispatcher's database is fine is charged as usual (retried, then failed), not taken for an
// outage and retried for ever without an attempt.
func TestOutageWordsWithoutOutage(t *testing.T) {
	s := newTestSchema(t)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "MAX_ATTEMPTS = 2\nRETRY_DELAY = 0.1"), "refused")
	id := insertOne(t, s, "a", `{}`)
	waitFor(t, 30*time.Second, "the message failed", func() bool { return row(t, s, id).status == "failed" })
	if r := row(t, s, id); r.attempts != 2 || !strings.Contains(r.reason, "connection refused") {
		t.Errorf("row %+v, want failed after 2 attempts with the stage's reason", r)
	}
	d.stop()
}

// TestOrdinaryRole: the dispatcher, its workers and /metrics as an ordinary role (no superuser,
// no pg_read_all_settings) that owns its schema, on the Unix socket: the usual local setup
// (host=/run/postgresql, a role of the system's own). The tests' roles were superusers, and
// hid that such a dispatcher could not start: naming its server read unix_socket_directories,
// which PostgreSQL shows to superusers and members of pg_read_all_settings alone ("take
// single-instance lock: pq: must be superuser or have privileges of pg_read_all_settings to
// examine "unix_socket_directories"", exit 1).
func TestOrdinaryRole(t *testing.T) {
	s := newTestSchema(t)
	role := ordinaryOwner(t, s, runsDDL)
	addr := freePort(t)
	conf := confAs(strings.Replace(threeStages(t, s), "[pepsi-dispatch]\n", "[pepsi-dispatch]\nMETRICS_LISTEN = "+addr+"\n", 1), s, role)
	d := startDaemon(t, conf, "pipeline")
	enqueue(t, s, "a", 100, `{}`)
	waitFor(t, 30*time.Second, "100 messages through three stages", func() bool { return countStatus(t, s, "done") == 100 })
	if v, ok := metric(t, addr, "pepsi_stray_stages"); !ok || v != 0 {
		t.Errorf("/metrics as %s: pepsi_stray_stages %v (%v)", role, v, ok)
	}
	d.stop()
	checkExactlyOnce(t, s, 100)
}

// TestOrdinaryRoleFanin: fan-out and fan-in as an ordinary role that owns its schema: the
// split, the children's evidence (the statement trigger, ENABLE ALWAYS), the flush and the
// wake.
func TestOrdinaryRoleFanin(t *testing.T) {
	s := newTestSchema(t)
	role := ordinaryOwner(t, s, faninDaemonDDL)
	d := faninStart(t, confAs(faninConf(t, s, "", ""), s, role), "fanin")
	ids := faninParents(t, s, `{"n": 3}`, `{"n": 200}`, `{"range": [1, 3000], "max_children": 3, "min_span": 1}`)
	faninWaitJoined(t, s, ids, 60*time.Second)
	for i, n := range []int{3, 200, 3} {
		faninExpectJoin(t, s, ids[i], n, 0)
	}
	faninCheckQuiescent(t, s)
	d.stop()
}

// ordinaryOwner makes s's schema again as a new role's, a role with no privilege of its own (no
// superuser, no pg_read_all_settings), as an operator applies schema.sql as the system's role,
// with the tests' own tables (ddl); the role is dropped with what it owns when t ends.
func ordinaryOwner(t *testing.T, s *testSchema, ddl string) string {
	t.Helper()
	role := "ordinary_" + s.Name
	s.exec(t, `CREATE ROLE `+role+` LOGIN NOSUPERUSER`)
	t.Cleanup(func() {
		s.DB.Exec(`DROP OWNED BY ` + role)
		s.DB.Exec(`DROP ROLE IF EXISTS ` + role)
	})
	s.exec(t, `DROP SCHEMA `+s.Name+` CASCADE`)
	s.exec(t, `CREATE SCHEMA `+s.Name)
	s.exec(t, `GRANT ALL ON SCHEMA `+s.Name+` TO `+role)
	own, err := sql.Open("postgres", s.DSN+" user="+role)
	if err != nil {
		t.Fatal(err)
	}
	defer own.Close()
	schema := schemaDDL(t)
	for _, q := range []string{schema, ddl} {
		if _, err := own.Exec(q); err != nil {
			t.Fatalf("apply the schema as %s: %v", role, err)
		}
	}
	if n := s.count(t, `SELECT count(*) FROM pg_roles WHERE rolname = $1 AND (rolsuper OR pg_has_role(oid, 'pg_read_all_settings', 'MEMBER'))`, role); n != 0 {
		t.Fatalf("%s may read every setting: not an ordinary role", role)
	}
	return role
}

// TestFailoverPrimaryVanishes: the primary's machine vanishes mid-run (its network gone, so
// nothing it says reaches the dispatcher any more: no FIN, no RST, its SYNs lost as beyond a
// router; its server dies with it) and the standby is promoted. The dispatcher and its workers
// run in a network namespace that reaches each server through a link of its own
// (netns_test.go). A primary that stops closes its sockets and the dispatcher learns it at its
// next statement (TestFailoverMidRun); here it learns nothing. A statement on the vanished
// server waited for the kernel's retransmissions to give up (net.ipv4.tcp_retries2: about 15
// minutes); every new connection tried the vanished first host to the end of its statement's
// budget, leaving none for the promoted standby listed second, so that the dispatcher never
// reached it; a worker started after the re-lock waited on its SYNs (about 2 minutes). The
// lock must be taken on the new primary within LOCK_KEEPALIVE's bound and every message
// finished once, none charged, as when a primary stops; beside a standby dispatcher, either
// may win the lock.
func TestFailoverPrimaryVanishes(t *testing.T) {
	for _, withStandby := range []bool{false, true} {
		name := "alone"
		if withStandby {
			// A standby dispatcher on a machine of its own (another namespace) whose lock wait
			// is on the same vanished primary: the two race for the lock on the new one, and
			// either may win.
			name = "beside a standby dispatcher"
		}
		t.Run(name, func(t *testing.T) { primaryVanishes(t, withStandby) })
	}
}

func primaryVanishes(t *testing.T, withStandby bool) {
	p := newPGPair(t)
	machines := []*testNetns{newTestNetns(t, 2)}
	if withStandby {
		machines = append(machines, newTestNetns(t, 2))
	}
	for i := range 2 {
		var addrs, peers []string
		for _, m := range machines {
			addrs, peers = append(addrs, m.hostAddr[i]), append(peers, m.nsAddr[i])
		}
		serveOn(t, p.script, p.dirs[i], addrs, peers)
	}
	s := p.schema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(threeStages(t, s), "SHUTDOWN_GRACE = 5", "SHUTDOWN_GRACE = 5\nSTANDBY = yes", 1)
	confOn := func(m *testNetns) string {
		dsn := fmt.Sprintf("host=%s,%s port=%s,%s user=postgres dbname=postgres sslmode=disable "+
			"target_session_attrs=read-write options='-c search_path=%s'",
			m.hostAddr[0], m.hostAddr[1], p.ports[0], p.ports[1], s.Name)
		return strings.Replace(conf, s.DSN, dsn, 1)
	}
	d := startDaemonWrapped(t, machines[0].wrap, confOn(machines[0]), "pipeline")
	d.waitLog("dispatching", 60*time.Second)
	var sb *daemon
	var sbMetrics string
	if withStandby {
		// /metrics on the standby's machine, reached from here by its link to the standby
		// server, which stays up.
		_, port, _ := strings.Cut(freePort(t), ":")
		sbMetrics = machines[1].nsAddr[1] + ":" + port
		sbConf := strings.Replace(confOn(machines[1]), "STANDBY = yes", "STANDBY = yes\nMETRICS_LISTEN = "+sbMetrics, 1)
		sb = startDaemonWrapped(t, machines[1].wrap, sbConf, "pipeline")
		sb.waitLog("standby: another dispatcher holds the single-instance lock; waiting for it", 60*time.Second)
	}
	const n = 300
	enqueue(t, s, "a", n, `{"sleep_ms": 20}`)
	waitFor(t, 120*time.Second, "the batch under way", func() bool { return poll(s, `SELECT count(*) FROM runs`) >= n/4 })
	for _, m := range machines {
		m.cut(0) // the primary's machine vanishes for the dispatchers and their workers,
	}
	p.killPrimary() // and its server with it: what it says as it stops is lost on the cut links
	p.promote()
	promoted := time.Now()
	winner := d
	waitFor(t, 3*time.Minute, "the lock taken on the new primary", func() bool {
		if sb != nil && strings.Contains(sb.log.String(), "took over the single-instance lock") {
			winner = sb
			return true
		}
		return strings.Contains(d.log.String(), "single-instance lock taken again")
	})
	relocked := time.Since(promoted)
	waitFor(t, 3*time.Minute, "every message done", func() bool {
		return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == n
	})
	finished := time.Since(promoted)
	who := "the dispatcher re-took the lock"
	if winner == sb {
		who = "the standby took the lock over"
	}
	t.Logf("after the promotion: %s in %v, every message done in %v", who, relocked.Round(time.Millisecond), finished.Round(time.Millisecond))
	// LOCK_KEEPALIVE (10 s) to notice, one connect attempt on the vanished host, then the
	// new primary: 30 s leaves room for a loaded machine, and is far from the kernel's minutes.
	if relocked > 30*time.Second {
		t.Errorf("the lock was taken %v after the promotion, want within 30 s", relocked.Round(time.Millisecond))
	}
	if finished > 45*time.Second {
		t.Errorf("every message was done %v after the promotion, want within 45 s", finished.Round(time.Millisecond))
	}
	checkExactlyOnce(t, s, n)
	checkRodeOut(t, s, winner, "the failover")
	// The workers' sockets give the server up about when the dispatcher's do: their deaths
	// are the outage's, not crashes charged to their head messages.
	for _, x := range []*daemon{d, sb} {
		if x != nil && strings.Contains(x.log.String(), "worker crashed") {
			t.Errorf("a worker's death in the outage was taken for a crash")
		}
	}
	if winner == sb {
		// Taken over, and said so, whether its wait returned or was cut with its session
		// and the lock found free at the next attempt.
		if body := scrape(sbMetrics); !strings.Contains(body, "pepsi_takeovers_total 1") {
			t.Errorf("the standby's metrics do not count its takeover:\n%s", body)
		}
		// The dispatcher that lost: its re-lock finds the lock held, and it exits 1.
		if st := d.wait(60 * time.Second); st != 1 {
			t.Errorf("the dispatcher the standby took over from exited %d, want 1", st)
		}
	} else if sb != nil {
		select {
		case <-sb.done:
			t.Errorf("the standby dispatcher exited (status %d) when the other one kept the lock", sb.status)
		default:
		}
	}
	winner.stop()
}

// TestLockLossSeenWhileStagesFull: the lock connection ends (here pg_terminate_backend; as much
// a firewall's or a pooler's cut, or a server that vanished) while every stage is full and its
// workers busy in their handlers. No reply comes, so no claim is asked for, and the heartbeat's
// claim has nothing to take: nothing went over the lock connection, and its loss went unseen
// for as long as the handlers ran, a standby free to take over meanwhile. The heartbeat now
// proves the connection when its claim sent nothing: the loss is seen within a POLL_INTERVAL
// or so, the lock taken again on the same server, and the workers, whose sessions are there
// still, are left alone.
func TestLockLossSeenWhileStagesFull(t *testing.T) {
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 2"), "pipeline")
	for range 2 {
		insertOne(t, s, "a", `{"hang_at": "a"}`)
	}
	waitFor(t, 30*time.Second, "both messages running", func() bool { return countStatus(t, s, "running") == 2 })
	d.waitLog("worker started", 10*time.Second)
	if n := s.count(t, `SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objid = to_regclass('workqueue')::oid::bigint`, lockClass); n != 1 {
		t.Fatalf("terminated %d lock sessions, want 1", n)
	}
	cut := time.Now()
	// POLL_INTERVAL = 1 (baseConf): a heartbeat a second, and a margin for a loaded machine.
	d.waitLog("single-instance lock taken again", 15*time.Second)
	t.Logf("lock taken again %v after its session was ended", time.Since(cut).Round(time.Millisecond))
	if !strings.Contains(d.log.String(), `op="prove the lock connection"`) {
		t.Errorf("the loss was not seen by the heartbeat's proof of the lock connection")
	}
	if strings.Contains(d.log.String(), "its session was on the one that went away") {
		t.Errorf("a worker was killed though the lock is on the server its session is on")
	}
	if n := countStatus(t, s, "running"); n != 2 {
		t.Errorf("%d rows running after the re-lock, want the 2 the worker holds", n)
	}
}

// TestRelockAfterRestartRetiresWorkers: the server restarts while the worker is busy in its
// handler, and comes back at the same address (as a virtual IP or a DNS name moved to a
// promoted standby does). The lock is taken again there, and the postmaster's start time says
// it is another run of the server: the worker's session, opened before, is not on it. The
// worker is killed and its messages claimed again by a new one, no attempt charged; by the
// address alone it was kept, to learn of its lost session only at its next statement, or, had
// the machine behind the address vanished, to wait on it for minutes
// (TestFailoverPrimaryVanishes).
func TestRelockAfterRestartRetiresWorkers(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	p := newPGNodes(t, 1, "pepsi-test-restart-")
	s := p.schema(t)
	s.exec(t, runsDDL)
	d := startDaemon(t, baseConf(s, "")+stageConf(t, "a", "", "PARALLELISM = 1\nQUEUE_LIMIT = 2"), "pipeline")
	for range 2 {
		insertOne(t, s, "a", `{"hang_at": "a"}`)
	}
	// In its handler: its batch loaded (the SDK sends BEGIN with its first write, which a
	// hung handler never makes). A restart before the load is the worker's own to see, there.
	waitFor(t, 30*time.Second, "the worker in its handler", func() bool {
		return poll(s, `SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pepsi-worker %'
			AND state = 'idle' AND query LIKE 'SELECT workqueue_id, attempts, payload, state FROM workqueue%'`) == 1
	})
	before := workerPids(t, d)
	if len(before) != 1 {
		t.Fatalf("worker pids %v, want one", before)
	}
	p.run("restart", p.dirs[0])
	d.waitLog("single-instance lock taken again", 60*time.Second)
	d.waitLog("its session was on the one that went away", 10*time.Second)
	waitFor(t, 30*time.Second, "both messages with a new worker", func() bool {
		now := workerPids(t, d)
		return len(now) == 1 && now[0] != before[0] &&
			poll(s, `SELECT count(*) FROM workqueue WHERE status = 'running'`) == 2
	})
	if n := poll(s, `SELECT count(*) FROM workqueue WHERE attempts <> 0`); n != 0 {
		t.Errorf("%d messages charged an attempt for the restart", n)
	}
}

// TestStandbyTakesOverFromVanishedHolder: the active dispatcher's machine vanishes (its network
// cut: the dispatcher and its workers run in a network namespace that reaches the server by one
// link, set down mid-run). The server hears nothing more from the holder's lock session and
// ends it within LOCK_KEEPALIVE (its keepalives, set by the lock session), which frees the lock:
// the standby takes over, fences the holder's workers and runs every message once. When the
// network comes back, the old dispatcher finds its lock gone and held, and exits 1. This is the
// "machine vanishes" row of doc/high-availability.md's table, measured there by hand before.
func TestStandbyTakesOverFromVanishedHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster")
	}
	p := newPGNodes(t, 1, "pepsi-test-holder-")
	ns := newTestNetns(t, 1)
	serveOn(t, p.script, p.dirs[0], ns.hostAddr[:1], ns.nsAddr[:1])
	s := p.schema(t)
	s.exec(t, runsDDL)
	conf := strings.Replace(threeStages(t, s), "SHUTDOWN_GRACE = 5", "SHUTDOWN_GRACE = 5\nSTANDBY = yes", 1)
	over := fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres sslmode=disable options='-c search_path=%s'",
		ns.hostAddr[0], p.ports[0], s.Name)
	holder := startDaemonWrapped(t, ns.wrap, strings.Replace(conf, s.DSN, over, 1), "pipeline")
	holder.waitLog("dispatching", 60*time.Second)
	standby := startDaemon(t, conf, "pipeline")
	standby.waitLog("standby: another dispatcher holds the single-instance lock; waiting for it", 30*time.Second)
	const n = 300
	enqueue(t, s, "a", n, `{"sleep_ms": 20}`)
	waitFor(t, 60*time.Second, "some progress", func() bool { return poll(s, `SELECT count(*) FROM runs`) >= n/4 })
	ns.cut(0)
	cut := time.Now()
	standby.waitLog("took over the single-instance lock", 60*time.Second)
	took := time.Since(cut)
	waitFor(t, 120*time.Second, "all done after the takeover", func() bool {
		return poll(s, `SELECT count(*) FROM workqueue WHERE status = 'done'`) == n
	})
	t.Logf("takeover %v after the holder's network was cut, every message done %v after", took.Round(time.Millisecond),
		time.Since(cut).Round(time.Millisecond))
	// LOCK_KEEPALIVE is 10 s: the server's probes start after 5 s of silence, 1 s apart.
	if took > 20*time.Second {
		t.Errorf("takeover %v after the cut, want within LOCK_KEEPALIVE (10 s) and a margin", took.Round(time.Millisecond))
	}
	checkExactlyOnce(t, s, n)
	ns.heal(0)
	if st := holder.wait(60 * time.Second); st != 1 {
		t.Errorf("the old dispatcher exited %d once its network came back, want 1", st)
	}
	if !strings.Contains(holder.log.String(), "single-instance lock lost") {
		t.Errorf("the old dispatcher did not say it lost its lock")
	}
	checkExactlyOnce(t, s, n)
	standby.stop()
}

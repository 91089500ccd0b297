// Command pepsi-dispatch moves messages through the stages of a pipeline kept in PostgreSQL.
//
// # Overview
//
// One coordinator per system claims newly queued rows of the workqueue table for every stage
// in one UPDATE … RETURNING, and feeds their ids through stdin pipes to persistent, pipelined
// worker processes (elastic pools per stage). Stages write their own outcome (advance, done,
// defer, split) under a guard; the dispatcher writes only failures and resets, under the
// claim's guard. It also serves Wikimedia's PoolCounter lock protocol when [poolcounter]
// LISTEN is set.
//
// # Lifecycle
//
// serve: read the configuration (exit 2 on a mistake), open the listening sockets, drop
// privileges, take the single-instance lock on a writable server (waiting for one; exit 1 if
// another dispatcher holds it, or with STANDBY = yes wait for its session to end: standby.go),
// fence off a previous run's workers and reset its orphaned rows, LISTEN, then run the
// coordinator (coordinator.go) until SIGINT/SIGTERM. A lost lock connection (a failover) is
// re-taken and followed by a reconcile (reconcile.go). Shutdown lets workers finish their queue within
// SHUTDOWN_GRACE, kills the rest, puts their rows back to pending, flushes statistics, exit 0.
//
// # Caveats
//
// Workers must connect with PEPSI_DSN (it names their sessions) for the start-up fence to
// find them; they are killed with their dispatcher by the kernel (parent-death signal).
// A stage that crashes on its very first message within startupWindow is taken for a
// program that cannot start: the stage is held and the message stays pending.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"os/user"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"pepsi-dispatch/internal/dsnsecret"
)

// version is set at build time: go build -ldflags "-X main.version=1.2.3".
var version = "dev"

func main() {
	oneProc(os.Getenv)
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

// oneProc runs the daemon on one processor (runtime.GOMAXPROCS(1)) unless its environment
// sets GOMAXPROCS, as the stage SDK does for its workers (stage/serve.go). The dispatcher's
// work is one goroutine's: the coordinator owns all state (coordinator.go), and the goroutines
// around it (LISTEN, the pipes' readers, the database calls, the lock service's connections,
// the console) mostly hand it events or wait. With a processor per core, the Go runtime wakes
// an idle thread to look for work at such hand-offs, and on a small machine whose cores
// PostgreSQL and the workers share, a message then waits for a CPU more often.
//
// Measured with bench/pipeline on 2 cores, -pepsi-env GOMAXPROCS=1 against the default, three
// alternating rounds: W3 at 20/s, enqueue -> done p99 3.67-4.09 ms against 4.30-4.69, enqueue
// -> start p99 2.20-2.65 against 3.16-3.44; W1 (medians of 5 per round) 57,116-62,017 against
// 57,162-57,897 transitions/s, with 28.6-30.3 against 30.0-30.6 CPU ms per 1,000; W2
// 50,405-58,706 against 52,648-57,054. The lock service decides under one mutex
// (poolcounter.go), in the order of the single-threaded poolcounterd, and bench/poolcounter
// pins the daemon to one CPU, which gives it one processor already: its figures are this
// setting's. A machine whose lock service or console needs more sets GOMAXPROCS
// (pepsi-dispatch(1), ENVIRONMENT). run leaves the runtime alone: tests call it in-process.
func oneProc(getenv func(string) string) {
	if getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
}

const usage = "usage: pepsi-dispatch [-c FILE] [-L error|warn|info|debug] [-v] serve"

// run is the whole program; it returns the exit status: 0 after a clean shutdown, 2 for a
// usage or configuration mistake, 1 for anything else. Standard output carries only the
// usage asked for (-h); everything else goes to stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if f, ok := stderr.(*os.File); ok && toJournal(f) {
		stderr = journalWriter{stderr} // each record with its priority (journal.go)
	}
	red := newRedactor(stderr) // no password reaches the log, whatever carries it (secret.go)
	stderr = red
	fs := flag.NewFlagSet("pepsi-dispatch", flag.ContinueOnError)
	// The usage is written once the parse says why: asked for (-h), it is the answer, on
	// standard output with status 0 (pepsi-dispatch -h | less); after a mistake, standard error.
	var usageText bytes.Buffer
	fs.SetOutput(&usageText)
	confPath := fs.String("c", configFileDefault, "configuration `file`")
	levelName := fs.String("L", "info", "log `level`: error, warn, info or debug")
	verbose := fs.Bool("v", false, "verbose: same as -L debug")
	fs.Usage = func() {
		fmt.Fprintln(&usageText, usage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			stdout.Write(usageText.Bytes())
			return 0
		}
		stderr.Write(usageText.Bytes())
		return 2
	}
	if fs.NArg() != 1 || fs.Arg(0) != "serve" {
		fmt.Fprintln(stderr, usage)
		return 2
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*levelName)); err != nil {
		fmt.Fprintf(stderr, "pepsi-dispatch: -L: want error, warn, info or debug, got %q\n", *levelName)
		return 2
	}
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	cfg, err := loadConfig(*confPath)
	if err != nil {
		fmt.Fprintf(stderr, "pepsi-dispatch: %v\n", err)
		return 2
	}
	red.add(dsnsecret.Secrets(cfg.DSN)...)
	if keys := dsnsecret.Settings(cfg.DSN); len(keys) > 0 {
		// Not an error: the daemon and Go stages take them, and a system may have no other.
		log.Warn("the DSN sets session settings as connection keys, which lib/pq takes and libpq refuses: "+
			"a stage using libpq (the Python SDK, psql) will not connect; write them as options='-c NAME=VALUE'",
			"keys", strings.Join(keys, ","))
	}
	err = serve(ctx, cfg, log)
	var ce *configError
	var re *reloadError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &re):
		log.Error("fatal", "err", err) // a reload's mistake ends a running dispatcher: 1
		return 1
	case errors.As(err, &ce):
		fmt.Fprintf(stderr, "pepsi-dispatch: %v\n", err) // once, as load-time mistakes are
		return 2
	default:
		log.Error("fatal", "err", err)
		return 1
	}
}

// serve runs the daemon until a signal (nil) or a fatal error.
func serve(ctx context.Context, cfg *Config, log *slog.Logger) error {
	if cfg.DSN == "" && cfg.PoolCounter.Listen == "" {
		return &configError{cfg.Path, "", "nothing to run: set [database] DSN (dispatcher) or [poolcounter] LISTEN (lock service)"}
	}
	if err := keepInheritedFromWorkers(); err != nil {
		log.Warn("descriptors the daemon was started with may reach its workers", "err", err)
	}
	sigs := make(chan os.Signal, 2) // two: the shutdown and the one that hurries it
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	// poolcounterd restarts gracefully on SIGUSR1; its operators may send it out of habit.
	// Go ignores it already; say so explicitly, so no later Notify changes that by accident.
	signal.Ignore(syscall.SIGUSR1)
	// SIGHUP reloads the stage graph (as a config_changed notification does); without a
	// dispatcher it is ignored. Go's default would end the process.
	hups := make(chan os.Signal, 1) // one pending reload is as good as many
	signal.Notify(hups, syscall.SIGHUP)
	defer signal.Stop(hups)

	// Sockets first: a privileged port must be bound before the privileges go.
	var pcLn net.Listener
	if cfg.PoolCounter.Listen != "" {
		var err error
		if pcLn, err = listenPoolCounter(cfg.PoolCounter.Listen); err != nil {
			return fmt.Errorf("listen on [poolcounter] LISTEN %s: %w", cfg.PoolCounter.Listen, err)
		}
		defer pcLn.Close()
	}
	var metricsLn net.Listener
	if cfg.Dispatch.MetricsListen != "" {
		var err error
		if metricsLn, err = listenMetrics(cfg.Dispatch.MetricsListen); err != nil {
			return err
		}
		defer metricsLn.Close()
	}
	if err := cfg.loadConsoleToken(); err != nil {
		return err
	}
	if err := dropPrivileges(cfg, log); err != nil {
		return err
	}
	log.Info("pepsi-dispatch starting", "version", version, "pid", os.Getpid(), "config", cfg.Path,
		"procs", runtime.GOMAXPROCS(0))
	sd := newNotifier()
	defer sd.close()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var side sync.WaitGroup // the lock service and other side services
	defer side.Wait()
	defer cancel() // runs before side.Wait: services stop, then we wait for them
	var ls *lockServer
	if pcLn != nil {
		ls = newLockServer(log) // it names its own component
		side.Add(1)
		go func() {
			defer side.Done()
			if err := ls.Serve(ctx, pcLn); err != nil {
				log.Error("lock service stopped", "err", err)
			}
		}()
		log.Info("lock service listening", "addr", pcLn.Addr().String())
	}
	var ha *haBoard // the dispatcher's role and server, for the log and /metrics (failover.go)
	if cfg.DSN != "" {
		ha = &haBoard{}
	}
	var metrics *metricsServer
	if metricsLn != nil {
		metrics = &metricsServer{locks: ls, ha: ha, log: log.With("component", "metrics"), version: version}
		if cfg.DSN != "" {
			if err := metrics.addConsole(cfg.consoleToken); err != nil {
				return err
			}
		}
		// It serves from the start: a dispatcher waiting for a primary or, as a standby, for
		// the lock says so there; the row gauges come once the pool exists (metrics.db).
		side.Add(1)
		go func() { defer side.Done(); metrics.serve(ctx, metricsLn) }()
		log.Info("metrics endpoint listening", "addr", metricsLn.Addr().String())
	}
	if cfg.DSN == "" {
		log.Info("no [database] DSN: running the lock service alone")
		sd.send("READY=1")
		var ping <-chan time.Time
		if d := watchdogInterval(); d > 0 {
			t := time.NewTicker(d)
			defer t.Stop()
			ping = t.C
		}
		for {
			select {
			case s := <-sigs:
				sd.send("STOPPING=1")
				log.Info("shutting down", "signal", s.String())
				return nil
			case <-ping:
				sd.send("WATCHDOG=1")
			}
		}
	}
	return serveDispatch(ctx, cfg, log.With("component", "dispatch"), sigs, hups, metrics, sd, ha)
}

// serveDispatch runs the dispatcher part: lock, fence, reset, LISTEN, coordinate.
func serveDispatch(ctx context.Context, cfg *Config, log *slog.Logger, sigs, hups <-chan os.Signal,
	metrics *metricsServer, sd *notifier, ha *haBoard) error {
	inst, db, err := connect(ctx, cfg, log, sigs, ha)
	if err != nil || inst == nil {
		return err // inst == nil, err == nil: a signal arrived while waiting for the database
	}
	defer db.Close()
	defer inst.close()
	killed, err := inst.fence(ctx, version)
	if err != nil {
		return err
	}
	orphans, orphansReset, orphansHeld, orphansRefused, err := inst.resetOrphans(ctx)
	if err != nil {
		return err
	}
	log.Info("single-instance lock taken", "epoch", inst.epoch, "fenced_sessions", killed, "orphans_reset", orphansReset,
		"orphans_held", len(orphansHeld)+len(orphansRefused), "server", inst.server.addr)
	workN, webN := poolShares(cfg.Dispatch.DBPoolSize, metrics != nil)
	work, err := openWorkPool(cfg, inst, workN) // db keeps the lock connection alone
	if err != nil {
		return err
	}
	defer work.Close()
	web := work // the HTTP listener's pool (poolShares)
	if webN > 0 {
		if web, err = openWorkPool(cfg, inst, webN); err != nil {
			return err
		}
		defer web.Close()
		web.SetConnMaxIdleTime(5 * time.Minute) // a console looked at once keeps no session
	}

	overlay, err := readOverlay(ctx, inst.conn)
	if err != nil {
		return err
	}
	stages, err := buildStages(cfg.stageEntries, overlay)
	if err != nil {
		return err // a configError: exit 2
	}
	fileStages := fileStagesJSON(cfg.stageEntries)
	if err := publishFileStages(ctx, inst.conn, fileStages); err != nil {
		return err // the lock connection failed a one-row write: the database is in trouble
	}
	run := *cfg
	run.Stages = stages

	listener, err := openListener(ctx, cfg, inst, work, log)
	if err != nil {
		return err
	}
	var drained sync.WaitGroup
	defer drained.Wait()
	defer func() {
		// Keep draining until the listener closes its channel: its sender would block otherwise.
		drained.Add(1)
		go func() {
			defer drained.Done()
			for range listener.Notify {
			}
		}()
		listener.close()
	}()

	cctx, stop := context.WithCancel(ctx)
	defer stop()
	var retain *retainer
	if cfg.Dispatch.Retention > 0 {
		retain = &retainer{age: cfg.Dispatch.Retention}
	}
	if metrics != nil {
		metrics.db.Store(web)
	}
	c := newCoordinator(cctx, coordinatorDeps{cfg: &run, version: version, log: log, db: work, inst: inst,
		notify: listener.Notify, sigs: sigs, hups: hups, metrics: metrics, notifier: sd, retain: retain, ha: ha,
		orphans: orphans, orphansHeld: orphansHeld, orphansRefused: orphansRefused})
	if metrics != nil {
		metrics.publish(c.snapshot())
	}
	c.fileStages = fileStages
	c.faninStartup()
	log.Info("dispatching", "stages", len(stages), "orphans_reset", orphansReset)
	sd.send("READY=1")
	err = c.loop()
	stop()      // worker goroutines give up any send still pending
	c.wg.Wait() // and are gone before the connections close
	return err
}

// dropPrivileges switches to USER when started as root, before any worker starts, so that
// every worker inherits the unprivileged account. Go applies setuid to all threads.
func dropPrivileges(cfg *Config, log *slog.Logger) error {
	if os.Geteuid() != 0 {
		return nil
	}
	name := cfg.Dispatch.User
	u, err := user.Lookup(name)
	if err != nil {
		return &configError{cfg.Path, "USER", fmt.Sprintf("started as root, but account %q does not exist (%v); "+
			"create it or set USER in [pepsi-dispatch]; refusing to run as root", name, err)}
	}
	uid, err1 := strconv.Atoi(u.Uid)
	gid, err2 := strconv.Atoi(u.Gid)
	if err1 != nil || err2 != nil {
		return fmt.Errorf("drop privileges to %s: non-numeric uid %q or gid %q", name, u.Uid, u.Gid)
	}
	if uid == 0 {
		return &configError{cfg.Path, "USER", fmt.Sprintf("account %q is root; refusing to run as root", name)}
	}
	groups := []int{gid}
	if ids, err := u.GroupIds(); err == nil {
		for _, g := range ids {
			if n, err := strconv.Atoi(g); err == nil && n != gid {
				groups = append(groups, n)
			}
		}
	}
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("drop privileges to %s: setgroups: %w", name, err)
	}
	if err := syscall.Setgid(gid); err != nil {
		return fmt.Errorf("drop privileges to %s: setgid %d: %w", name, gid, err)
	}
	if err := syscall.Setuid(uid); err != nil {
		return fmt.Errorf("drop privileges to %s: setuid %d: %w", name, uid, err)
	}
	// As runuser(1) does: libpq and lib/pq look in $HOME for certificates and .pgpass, and
	// root's HOME is unreadable now (for the workers, who inherit it, too).
	for k, v := range map[string]string{"HOME": u.HomeDir, "USER": u.Username, "LOGNAME": u.Username} {
		if err := os.Setenv(k, v); err != nil {
			return fmt.Errorf("drop privileges to %s: set %s: %w", name, k, err)
		}
	}
	log.Info("dropped privileges", "user", name, "uid", uid, "gid", gid, "home", u.HomeDir)
	return nil
}

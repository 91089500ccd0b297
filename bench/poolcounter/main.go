// Command poolcounter is the load test of pepsi-dispatch's PoolCounter lock service against
// Debian's poolcounterd 1.1.3 (issue 5). It is a program, not a unit test.
//
// Owns: nothing of the daemon; it builds the daemon from the repository (go build -o), starts
// both servers itself on 127.0.0.1 (each pinned with taskset to the same CPU list), sends
// bounded load (in cycles and in time) to 127.0.0.1 only, stops both servers and prints one
// table.
//
// A cycle is ACQ4ME + RELEASE, each waiting for its reply. Modes:
//
//	distinct  N persistent connections, each on its own key
//	hot       N persistent connections on one key (workers 1: every cycle is a handoff)
//	churn     N concurrent clients, each cycle on a new connection (connect, ACQ4ME, RELEASE,
//	          close), as MediaWiki and Thumbor do
//
// Churn clients (-churn-client): epoll (the default, churn_epoll.go) drives all N clients from
// one thread over non-blocking sockets; net is the first generator (measure, below: a goroutine
// per client over Go's net package), kept so the two can be compared. At 256 clients the net
// client used 95-99 % of its CPU and was the bottleneck, not the servers.
//
// Placement: both servers run under `taskset -c -server-cpus` (default CPU 0, so our daemon
// gets GOMAXPROCS=1 like the single-threaded reference); this generator re-executes itself
// under `taskset -c -client-cpus` (default CPU 1). poolcounterd gets its listening socket as
// fd 0, made here exactly as it makes its own (no SO_REUSEADDR, backlog 20); ours opens its own
// through its configuration (backlog = net.core.somaxconn).
//
// Each case is measured -rounds times per server, alternating which server goes first, and the
// round with the median throughput is shown: the box may be shared, and outside load should
// fall on both servers alike.
//
// For churn it also prints where a cycle's time goes (connect, ACQ4ME including the wait to be
// accepted, RELEASE), the kernel's listen-queue counters during each server's measurement
// (ListenOverflows, ListenDrops, syncookies, SYN retransmits: non-zero means the backlog was
// too small and clients waited for a SYN retransmit, 1 s and more), the listen backlogs as ss
// shows them, the kernel settings that bound them, and the CPU both sides used: a side far below
// 100 % of its pinned CPU was waiting for that CPU (other load), not working.
//
// Usage (from the bench module): go run ./poolcounter [-duration 2s] [-rounds 3] [-conns 1,16,256]
// [-churn-client epoll|net] [-churn-sources 16]
package main

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// pinnedEnv marks the re-executed, pinned generator.
const pinnedEnv = "PC_BENCH_PINNED"

type options struct {
	repo, daemon, poolcounterd string
	serverCPUs, clientCPUs     string
	duration                   time.Duration
	rounds                     int
	maxCycles                  int64
	conns                      []int
	modes                      []string
	// churnClient is the churn generator, "epoll" or "net"; churnSources the number of
	// loopback source addresses the churn clients spread their connections over: from one
	// address, connect runs out of reusable ephemeral ports near 14,000 connections a second
	// (churn_epoll.go, Ephemeral ports).
	churnClient  string
	churnSources int
}

func main() {
	if addr := os.Getenv(floorEnv); addr != "" {
		os.Exit(serveFloor(addr))
	}
	os.Exit(run())
}

func run() int {
	var o options
	var conns, modes string
	flag.StringVar(&o.repo, "repo", "..", "pepsi-dispatch source directory to build the daemon from")
	flag.StringVar(&o.daemon, "daemon", "", "use this pepsi-dispatch binary instead of building one")
	flag.StringVar(&o.poolcounterd, "poolcounterd", "poolcounterd", "reference server binary")
	flag.StringVar(&o.serverCPUs, "server-cpus", "0", "taskset CPU list for both servers (empty: no pinning)")
	flag.StringVar(&o.clientCPUs, "client-cpus", "1", "taskset CPU list for this load generator (empty: no pinning)")
	flag.DurationVar(&o.duration, "duration", 2*time.Second, "length of one measurement")
	flag.IntVar(&o.rounds, "rounds", 3, "measurements per server and case, alternating servers; the median is shown")
	flag.Int64Var(&o.maxCycles, "max-cycles", 2_000_000, "cycle budget of one measurement")
	flag.StringVar(&conns, "conns", "1,16,256", "connection counts")
	flag.StringVar(&modes, "modes", "distinct,hot,churn", "modes")
	flag.StringVar(&o.churnClient, "churn-client", "epoll", "churn load generator: epoll (one thread, all clients) or net (a goroutine per client)")
	flag.IntVar(&o.churnSources, "churn-sources", 16, "churn: spread the connections over source addresses 127.0.0.1..127.0.0.N, each with its own ephemeral ports (1: 127.0.0.1 only, no bind)")
	flag.Parse()
	for _, s := range strings.Split(conns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || n > 4096 {
			fmt.Fprintf(os.Stderr, "bad -conns value %q\n", s)
			return 2
		}
		o.conns = append(o.conns, n)
	}
	for _, m := range strings.Split(modes, ",") {
		if m = strings.TrimSpace(m); m != "distinct" && m != "hot" && m != "churn" {
			fmt.Fprintf(os.Stderr, "bad -modes value %q\n", m)
			return 2
		}
		o.modes = append(o.modes, strings.TrimSpace(m))
	}
	if o.churnClient != "epoll" && o.churnClient != "net" {
		fmt.Fprintf(os.Stderr, "bad -churn-client value %q (epoll or net)\n", o.churnClient)
		return 2
	}
	if o.churnSources < 1 || o.churnSources > 254 {
		fmt.Fprintln(os.Stderr, "-churn-sources must be in 1..254")
		return 2
	}
	if o.duration <= 0 || o.duration > 5*time.Minute || o.maxCycles < 1 || o.rounds < 1 || o.rounds > 15 {
		fmt.Fprintln(os.Stderr, "-duration must be in (0, 5m], -max-cycles positive, -rounds in 1..15")
		return 2
	}

	if o.clientCPUs != "" && os.Getenv(pinnedEnv) == "" {
		return reexecPinned(o.clientCPUs)
	}
	if err := bench(o); err != nil {
		fmt.Fprintln(os.Stderr, "poolcounter bench:", err)
		return 1
	}
	return 0
}

// reexecPinned runs this program again under taskset so the generator's threads stay off the
// servers' CPUs.
func reexecPinned(cpus string) int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "find own executable:", err)
		return 1
	}
	cmd := exec.Command("taskset", append([]string{"-c", cpus, self}, os.Args[1:]...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), pinnedEnv+"=1")
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "run pinned generator:", err)
		return 1
	}
	return 0
}

func bench(o options) error {
	tmp, err := os.MkdirTemp("", "pcbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	daemon := o.daemon
	if daemon == "" {
		daemon = filepath.Join(tmp, "pepsi-dispatch")
		build := exec.Command("go", "build", "-o", daemon, ".")
		build.Dir = o.repo
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("build the daemon in %s: %w", o.repo, err)
		}
	}
	refPath, err := exec.LookPath(o.poolcounterd)
	if err != nil {
		return fmt.Errorf("find poolcounterd (apt-get install poolcounter): %w", err)
	}

	ours, err := startOurs(daemon, tmp, o.serverCPUs)
	if err != nil {
		return err
	}
	defer ours.stop()
	ref, err := startReference(refPath, o.serverCPUs)
	if err != nil {
		return err
	}
	defer ref.stop()
	floor, err := startFloor(o.serverCPUs)
	if err != nil {
		return err
	}
	defer floor.stop() //nolint:errcheck // killed by SIGTERM: its status says nothing

	fmt.Printf("servers pinned to CPUs %q, generator to %q; %v or %d cycles per measurement; median of %d alternating rounds; churn client %s\n",
		o.serverCPUs, o.clientCPUs, o.duration, o.maxCycles, o.rounds, o.churnClient)
	const row = "%-8s %5s %10s %10s %6s | %8s %8s %8s | %8s %8s %8s | %6s %7s\n"
	var churn []string // breakdowns, printed after the table
	fmt.Printf(row, "mode", "conns", "pepsi c/s", "ref c/s", "ratio", "p50", "p99", "max", "ref p50", "ref p99", "ref max", "p99 r", "errors")
	for _, mode := range o.modes {
		for _, n := range o.conns {
			// Alternate which server goes first, so that load from outside the benchmark
			// (other processes on a shared box) falls on both alike; keep the median round.
			var as, bs, fs []result // fs: the floor, churn only, a round after each pair
			for round := 0; round < o.rounds; round++ {
				for _, first := range []bool{round%2 == 0, round%2 != 0} {
					if first {
						a, err := measureServer(ours, mode, n, o)
						if err != nil {
							return fmt.Errorf("pepsi %s %d: %w", mode, n, err)
						}
						as = append(as, a)
					} else {
						b, err := measureServer(ref, mode, n, o)
						if err != nil {
							return fmt.Errorf("poolcounterd %s %d: %w", mode, n, err)
						}
						bs = append(bs, b)
					}
				}
				if mode == "churn" {
					f, err := measureServer(floor, mode, n, o)
					if err != nil {
						return fmt.Errorf("floor %s %d: %w", mode, n, err)
					}
					fs = append(fs, f)
				}
			}
			a, b := median(as), median(bs)
			fmt.Printf(row, mode, strconv.Itoa(n),
				fmt.Sprintf("%.0f", a.rate()), fmt.Sprintf("%.0f", b.rate()), fmt.Sprintf("%.2f", a.rate()/b.rate()),
				fmtDur(a.pct(50)), fmtDur(a.pct(99)), fmtDur(a.pct(100)),
				fmtDur(b.pct(50)), fmtDur(b.pct(99)), fmtDur(b.pct(100)),
				fmt.Sprintf("%.2f", float64(a.pct(99))/float64(b.pct(99))), fmt.Sprintf("%d/%d", a.errors, b.errors))
			if mode == "churn" {
				churn = append(churn, fmt.Sprintf("churn %d, where a cycle's time goes (p50/p99/max of the median round):", n),
					"  pepsi  "+breakdown(a), "  ref    "+breakdown(b),
					"  pepsi  kernel: "+a.net.String(), "  ref    kernel: "+b.net.String(),
					"  pepsi  "+pauseString(a), "  ref    "+pauseString(b))
				f := median(fs)
				churn = append(churn,
					fmt.Sprintf("  floor  (a server with no lock table: the generator, the kernel and Go's runtime alone) %.0f c/s, p50 %s p99 %s max %s",
						f.rate(), fmtDur(f.pct(50)), fmtDur(f.pct(99)), fmtDur(f.pct(100))),
					"  floor  "+breakdown(f), "  floor  "+pauseString(f),
					fmt.Sprintf("  CPU used / elapsed (processes; softirq not included): pepsi server %.0f%%, its generator %.0f%%; poolcounterd %.0f%%, its generator %.0f%%; floor %.0f%%, its generator %.0f%%",
						100*a.serverCPU.Seconds()/a.elapsed.Seconds(), 100*a.selfCPU.Seconds()/a.elapsed.Seconds(),
						100*b.serverCPU.Seconds()/b.elapsed.Seconds(), 100*b.selfCPU.Seconds()/b.elapsed.Seconds(),
						100*f.serverCPU.Seconds()/f.elapsed.Seconds(), 100*f.selfCPU.Seconds()/f.elapsed.Seconds()),
					fmt.Sprintf("  preempted by other tasks (involuntary context switches): pepsi server %d, its generator %d; poolcounterd %d, its generator %d; floor %d, its generator %d",
						a.serverPreempt, a.selfPreempt, b.serverPreempt, b.selfPreempt, f.serverPreempt, f.selfPreempt),
					"  CPUs (/proc/stat, machine-wide) pepsi:  "+cpuString(a.cpus),
					"  CPUs (/proc/stat, machine-wide) ref:    "+cpuString(b.cpus),
					"  CPUs (/proc/stat, machine-wide) floor:  "+cpuString(f.cpus))
			}
		}
	}
	for _, l := range churn {
		fmt.Println(l)
	}
	if len(churn) > 0 {
		fmt.Printf("kernel: net.core.somaxconn %s, net.ipv4.tcp_max_syn_backlog %s, tcp_syncookies %s, tcp_synack_retries %s, net.core.netdev_max_backlog %s; listen backlog (ss -ltn Send-Q): pepsi %s, poolcounterd %s\n",
			sysctl("net.core.somaxconn"), sysctl("net.ipv4.tcp_max_syn_backlog"), sysctl("net.ipv4.tcp_syncookies"),
			sysctl("net.ipv4.tcp_synack_retries"), sysctl("net.core.netdev_max_backlog"), backlog(ours.addr), backlog(ref.addr))
	}
	fmt.Println("ratio = pepsi/poolcounterd cycles per second (higher is better); p99 r = pepsi/poolcounterd p99 (lower is better)")
	if err := ours.stop(); err != nil {
		return fmt.Errorf("pepsi-dispatch: %w", err)
	}
	return ref.stop()
}

// ---------------------------------------------------------------------------------------------
// Servers

type server struct {
	name string
	addr string
	cmd  *exec.Cmd
	once sync.Once
	err  error
}

// stop sends SIGTERM and waits; both servers exit 0 on it.
func (s *server) stop() error {
	s.once.Do(func() {
		s.cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck // Wait reports the outcome
		done := make(chan error, 1)
		go func() { done <- s.cmd.Wait() }()
		t := time.NewTimer(10 * time.Second)
		defer t.Stop()
		select {
		case s.err = <-done:
		case <-t.C:
			s.cmd.Process.Kill() //nolint:errcheck // it did not stop in time
			s.err = fmt.Errorf("%s did not exit 10 s after SIGTERM", s.name)
			<-done
		}
	})
	return s.err
}

func pinned(cpus string, argv ...string) *exec.Cmd {
	if cpus == "" {
		return exec.Command(argv[0], argv[1:]...)
	}
	return exec.Command("taskset", append([]string{"-c", cpus}, argv...)...)
}

// startOurs runs `pepsi-dispatch -c FILE serve` with only the lock service configured.
func startOurs(bin, dir, cpus string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	conf := "[poolcounter]\nLISTEN = " + addr + "\n"
	if os.Geteuid() == 0 {
		// The daemon refuses to keep root; as root, run it as nobody.
		conf = "[pepsi-dispatch]\nUSER = nobody\n" + conf
	}
	path := filepath.Join(dir, "pepsi-dispatch.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	cmd := pinned(cpus, bin, "-c", path, "serve")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	s := &server{name: "pepsi-dispatch", addr: addr, cmd: cmd}
	if err := waitListening(addr); err != nil {
		s.stop() //nolint:errcheck // already failing
		return nil, err
	}
	return s, nil
}

// startReference runs poolcounterd on a listening socket made like its own (backlog 20, no
// SO_REUSEADDR) and handed over as fd 0, so it needs no fixed port.
func startReference(bin, cpus string) (*server, error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("reference socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), "poolcounterd-listener")
	defer f.Close() // the child keeps its copy
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		return nil, fmt.Errorf("reference bind: %w", err)
	}
	if err := syscall.Listen(fd, 20); err != nil { // BACKLOG in client_data.h
		return nil, fmt.Errorf("reference listen: %w", err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	cmd := pinned(cpus, bin)
	cmd.Stdin = f
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	return &server{name: "poolcounterd", addr: addr, cmd: cmd}, nil
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// waitListening polls until addr accepts a connection that answers STATS UPTIME.
func waitListening(addr string) error {
	deadline := time.Now().Add(15 * time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.SetDeadline(time.Now().Add(2 * time.Second)) //nolint:errcheck // the read fails if not applied
			_, err = io.WriteString(conn, "STATS UPTIME\n")
			if err == nil {
				var line string
				line, err = bufio.NewReader(conn).ReadString('\n')
				if err == nil && !strings.HasPrefix(line, "uptime: ") {
					err = fmt.Errorf("unexpected reply %q", line)
				}
			}
			conn.Close()
			if err == nil {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not answering after 15 s: %w", addr, err)
		}
		<-tick.C
	}
}

// ---------------------------------------------------------------------------------------------
// Load

type result struct {
	cycles  int64
	elapsed time.Duration
	lat     []time.Duration // sorted
	errors  int64
	// churn only: the cycle's three parts, each sorted: connect (the kernel's handshake, or
	// a SYN retransmit when the listen queue was full), ACQ4ME (includes waiting to be
	// accepted), RELEASE.
	connect, acq, release []time.Duration
	net                   netCounters // the kernel's listen-queue figures during the measurement
	// serverCPU and selfCPU: CPU time used by the server process and by this generator during
	// the measurement: near elapsed × CPUs given, that side was the bottleneck.
	serverCPU, selfCPU time.Duration
	// serverPreempt and selfPreempt: involuntary context switches of either side's threads:
	// another task on the machine took that side's CPU.
	serverPreempt, selfPreempt int64
	// cpus: each CPU's busy (softirq included), idle and steal time during the measurement
	// (/proc/stat), machine-wide. Steal is time the hypervisor ran something else, which no
	// process here can see: a stall of every client at once with steal beside it is the
	// host's, not the server's.
	cpus map[string]cpuTimes
	// ends: churn only, when each cycle ended, from the start of the measurement (sorted):
	// the longest pause between two ends shows a stall of every client at once.
	ends []time.Duration
	// slowStarts and slowEnds: when the slowest 1 % of the cycles started and ended (sorted):
	// bunched in one window, they are one event (a stall, another task on a CPU); spread over
	// the measurement, they are the ordinary queueing of a saturated closed loop.
	slowStarts, slowEnds []time.Duration
}

// longestPause is the longest time between two cycle ends and when it began.
func (r result) longestPause() (d, at time.Duration) {
	for i := 1; i < len(r.ends); i++ {
		if g := r.ends[i] - r.ends[i-1]; g > d {
			d, at = g, r.ends[i-1]
		}
	}
	return d, at
}

// pauseString formats longestPause.
func pauseString(r result) string {
	d, at := r.longestPause()
	s := fmt.Sprintf("longest pause with no cycle ending: %s, %s into the %s measurement", fmtDur(d), fmtDur(at), fmtDur(r.elapsed))
	if len(r.slowEnds) > 0 {
		s += fmt.Sprintf("; the slowest 1 %% (%d) started %s..%s (middle 80 %%: %s..%s), ended %s..%s", len(r.slowEnds),
			fmtDur(r.slowStarts[0]), fmtDur(r.slowStarts[len(r.slowStarts)-1]), fmtDur(pct(r.slowStarts, 10)), fmtDur(pct(r.slowStarts, 90)),
			fmtDur(r.slowEnds[0]), fmtDur(r.slowEnds[len(r.slowEnds)-1]))
	}
	return s
}

func (r result) rate() float64 { return float64(r.cycles) / r.elapsed.Seconds() }

// sortAll sorts the latency lists and counts the cycles. Before sorting it notes when the
// slowest 1 % of the cycles ran (r.ends and r.lat are in the same order until then).
func (r *result) sortAll() {
	r.cycles = int64(len(r.lat))
	if len(r.ends) == len(r.lat) && len(r.lat) >= 100 {
		idx := make([]int, len(r.lat))
		for i := range idx {
			idx[i] = i
		}
		slices.SortFunc(idx, func(x, y int) int { return cmp.Compare(r.lat[y], r.lat[x]) })
		slow := idx[:len(idx)/100]
		r.slowStarts, r.slowEnds = make([]time.Duration, len(slow)), make([]time.Duration, len(slow))
		for k, i := range slow {
			r.slowStarts[k], r.slowEnds[k] = r.ends[i]-r.lat[i], r.ends[i]
		}
		slices.Sort(r.slowStarts)
		slices.Sort(r.slowEnds)
	}
	for _, l := range [][]time.Duration{r.lat, r.connect, r.acq, r.release, r.ends} {
		slices.Sort(l)
	}
}

func (r result) pct(p int) time.Duration { return pct(r.lat, p) }

func pct(lat []time.Duration, p int) time.Duration {
	if len(lat) == 0 {
		return 0
	}
	i := (len(lat)*p + 99) / 100
	return lat[min(max(i-1, 0), len(lat)-1)]
}

// netCounters are the kernel's counters that tell where a connect waited: the accept queue
// overflowed (ListenOverflows, ListenDrops), the SYN queue was full (syncookies sent or SYNs
// dropped), SYN-ACKs or SYNs were retransmitted. They are machine-wide, so other processes on
// a shared box add to them.
//
// retrans (Tcp RetransSegs) counts every retransmitted segment, not only SYNs: a data segment
// lost on loopback waits for the retransmission timeout (200 ms at least); backlogDrops (the
// second column of /proc/net/softnet_stat, summed over CPUs) counts packets dropped because a
// CPU's input backlog (net.core.netdev_max_backlog) was full, which is how loopback loses them.
type netCounters struct {
	overflows, drops, cookies, reqQDrops, synRetrans int64
	retrans, backlogDrops                            int64
}

func readNetCounters() netCounters {
	var c netCounters
	b, err := os.ReadFile("/proc/net/netstat")
	if err != nil {
		return c
	}
	lines := strings.Split(string(b), "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != "TcpExt:" || len(names) != len(values) {
			continue
		}
		for j, n := range names {
			v, _ := strconv.ParseInt(values[j], 10, 64)
			switch n {
			case "ListenOverflows":
				c.overflows = v
			case "ListenDrops":
				c.drops = v
			case "TCPReqQFullDoCookies":
				c.cookies = v
			case "TCPReqQFullDrop":
				c.reqQDrops = v
			case "TCPSynRetrans":
				c.synRetrans = v
			}
		}
	}
	if b, err := os.ReadFile("/proc/net/snmp"); err == nil {
		lines := strings.Split(string(b), "\n")
		for i := 0; i+1 < len(lines); i++ {
			names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
			if len(names) == 0 || names[0] != "Tcp:" || len(values) != len(names) || values[0] != "Tcp:" {
				continue
			}
			if j := slices.Index(names, "RetransSegs"); j > 0 {
				c.retrans, _ = strconv.ParseInt(values[j], 10, 64)
			}
			break
		}
	}
	if b, err := os.ReadFile("/proc/net/softnet_stat"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 {
				v, _ := strconv.ParseInt(f[1], 16, 64)
				c.backlogDrops += v
			}
		}
	}
	return c
}

func (c netCounters) sub(o netCounters) netCounters {
	return netCounters{c.overflows - o.overflows, c.drops - o.drops, c.cookies - o.cookies, c.reqQDrops - o.reqQDrops, c.synRetrans - o.synRetrans,
		c.retrans - o.retrans, c.backlogDrops - o.backlogDrops}
}

func (c netCounters) String() string {
	return fmt.Sprintf("ListenOverflows %d, ListenDrops %d, syncookies %d, SYN drops %d, SYN retransmits %d",
		c.overflows, c.drops, c.cookies, c.reqQDrops, c.synRetrans) +
		fmt.Sprintf(", all retransmits %d, input backlog drops %d", c.retrans, c.backlogDrops)
}

// backlog reports a listening socket's backlog as ss shows it (Send-Q of a LISTEN line).
func backlog(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	out, err := exec.Command("ss", "-ltnH", "sport = :"+port).Output()
	if f := strings.Fields(string(out)); err == nil && len(f) >= 3 {
		return f[2]
	}
	return "?"
}

// sysctl reads one kernel setting for the report.
func sysctl(name string) string {
	b, err := os.ReadFile("/proc/sys/" + strings.ReplaceAll(name, ".", "/"))
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b)), " ")
}

// median returns the round with the median throughput.
func median(rs []result) result {
	slices.SortFunc(rs, func(x, y result) int {
		switch {
		case x.rate() < y.rate():
			return -1
		case x.rate() > y.rate():
			return 1
		}
		return 0
	})
	return rs[len(rs)/2]
}

// breakdown formats a churn result's three parts.
func breakdown(r result) string {
	part := func(name string, l []time.Duration) string {
		return fmt.Sprintf("%s %s/%s/%s", name, fmtDur(pct(l, 50)), fmtDur(pct(l, 99)), fmtDur(pct(l, 100)))
	}
	return part("connect", r.connect) + "  " + part("ACQ4ME", r.acq) + "  " + part("RELEASE", r.release)
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/1e6)
	default:
		return fmt.Sprintf("%dµs", d.Microseconds())
	}
}

// client is one line-protocol connection.
type client struct {
	conn net.Conn
	r    *bufio.Reader
}

func dial(addr string) (*client, error) {
	return dialFrom(addr, nil)
}

// dialFrom connects from a source address (port 0) when src is not nil, leaving the port to
// connect (IP_BIND_ADDRESS_NO_PORT) as the epoll client does (churn_epoll.go, Ephemeral ports).
func dialFrom(addr string, src *net.TCPAddr) (*client, error) {
	d := net.Dialer{Timeout: 10 * time.Second}
	if src != nil {
		d.LocalAddr = src
		d.Control = func(network, address string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_IP, ipBindAddressNoPort, 1)
			}); err != nil {
				return err
			}
			return serr
		}
	}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &client{conn: conn, r: bufio.NewReaderSize(conn, 256)}, nil
}

// call sends one request and checks its reply.
func (c *client) call(req, want string) error {
	if _, err := io.WriteString(c.conn, req); err != nil {
		return err
	}
	line, err := c.r.ReadSlice('\n')
	if err != nil {
		return err
	}
	if string(line) != want {
		return fmt.Errorf("%q: got %q, want %q", strings.TrimSpace(req), line, want)
	}
	return nil
}

// measureServer is one measurement, by the churn client chosen for churn, with the CPU time
// both sides used.
func measureServer(srv *server, mode string, n int, o options) (result, error) {
	pid := srv.cmd.Process.Pid
	s0, c0 := procCPU(pid), procCPU(os.Getpid())
	sp0, cp0 := preemptions(pid), preemptions(os.Getpid())
	var r result
	var err error
	if mode == "churn" && o.churnClient == "epoll" {
		r, err = measureChurnEpoll(srv.addr, n, o.duration, o.maxCycles, o.churnSources)
	} else {
		r, err = measure(srv.addr, mode, n, o.duration, o.maxCycles, o.churnSources)
	}
	r.serverCPU, r.selfCPU = procCPU(pid)-s0, procCPU(os.Getpid())-c0
	r.serverPreempt, r.selfPreempt = preemptions(pid)-sp0, preemptions(os.Getpid())-cp0
	return r, err
}

// procCPU is a process's user + system CPU time so far, from /proc/PID/stat (0 if unknown).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name (which may hold spaces) start after the last ')'.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100 // USER_HZ is 100 on Linux
}

// measure runs n workers of one mode until the duration or the cycle budget is used up, one
// goroutine each over Go's net package (for churn: -churn-client net).
func measure(addr, mode string, n int, d time.Duration, maxCycles int64, sources int) (result, error) {
	var budget atomic.Int64
	budget.Store(maxCycles)
	var errs atomic.Int64
	lats := make([][]time.Duration, n)
	phases := make([][3][]time.Duration, n)
	ends := make([][]time.Duration, n)
	clients := make([]*client, n)
	if mode != "churn" {
		for i := range clients {
			c, err := dial(addr)
			if err != nil {
				return result{}, err
			}
			defer c.conn.Close()
			clients[i] = c
		}
	}
	start := make(chan struct{})
	var startTime time.Time // set before start is closed
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var firstErr error
	var errOnce sync.Once
	fail := func(err error) {
		errs.Add(1)
		errOnce.Do(func() { firstErr = err; cancel() })
	}
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("bench-%s-%d", mode, i)
		acq := "ACQ4ME " + key + " 1 10 10\n"
		if mode == "hot" {
			acq = fmt.Sprintf("ACQ4ME bench-hot 1 %d 10\n", n+1)
		}
		var src *net.TCPAddr
		if sources > 1 {
			src = &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(1+i%sources))}
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			lat := make([]time.Duration, 0, 1024)
			var ph [3][]time.Duration
			var end []time.Duration
			<-start
			deadline := time.Now().Add(d)
			for ctx.Err() == nil && time.Now().Before(deadline) && budget.Add(-1) >= 0 {
				t0 := time.Now()
				c := clients[i]
				if mode == "churn" {
					var err error
					if c, err = dialFrom(addr, src); err != nil {
						fail(err)
						break
					}
				}
				t1 := time.Now()
				c.conn.SetDeadline(t0.Add(30 * time.Second)) //nolint:errcheck // a failed set shows up as a timeout
				err := c.call(acq, "LOCKED\n")
				t2 := time.Now()
				if err == nil {
					err = c.call("RELEASE\n", "RELEASED\n")
				}
				if mode == "churn" {
					c.conn.Close()
				}
				if err != nil {
					fail(err)
					break
				}
				t3 := time.Now()
				lat = append(lat, t3.Sub(t0))
				if mode == "churn" {
					ph[0], ph[1], ph[2] = append(ph[0], t1.Sub(t0)), append(ph[1], t2.Sub(t1)), append(ph[2], t3.Sub(t2))
					end = append(end, t3.Sub(startTime))
				}
			}
			lats[i], phases[i], ends[i] = lat, ph, end
		}(i)
	}
	before, cpus0 := readNetCounters(), readCPUTimes()
	startTime = time.Now()
	close(start)
	wg.Wait()
	r := result{elapsed: time.Since(startTime), errors: errs.Load(), net: readNetCounters().sub(before), cpus: subCPUTimes(readCPUTimes(), cpus0)}
	for i, l := range lats {
		r.lat = append(r.lat, l...)
		r.connect = append(r.connect, phases[i][0]...)
		r.acq = append(r.acq, phases[i][1]...)
		r.release = append(r.release, phases[i][2]...)
		r.ends = append(r.ends, ends[i]...)
	}
	r.sortAll()
	if firstErr != nil && r.cycles == 0 {
		return r, firstErr
	}
	if firstErr != nil {
		fmt.Fprintf(os.Stderr, "%s %s %d: %d errors, first: %v\n", addr, mode, n, r.errors, firstErr)
	}
	return r, nil
}

// worker.go: one worker process and the goroutines that watch it (the mechanism).
//
// A worker is `PROGRAM [-c CONFIG_FILE] worker`, started in its own process group so that a
// kill reaches its children too, and with the kernel's parent-death signal so that it cannot
// outlive a dispatcher that dies. It owns the pipes and two goroutines per process: readLoop
// (stdout replies, then the exit status) and logLoop (stderr to the log). Those goroutines only
// send events; every field below that is not marked otherwise is owned by the coordinator
// goroutine. When to start or stop a worker is pool.go's business, how its life goes
// supervise.go's, not this file's.

package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// replyMaxLine bounds one status line. Replies are a status and a short reason; a longer line
// is a protocol error, and the bound keeps a misbehaving worker from growing our memory.
const replyMaxLine = 64 << 10

// exitReadGrace is how long the exit watcher waits, after the process exited, for its stdout to
// reach EOF. Only a grandchild that inherited stdout can hold it open longer; it is then killed
// with the rest of the process group.
const exitReadGrace = 2 * time.Second

// message is one claimed row in flight.
type message struct {
	id       int64
	stage    string
	claim    int64  // the claim token the failure and reset writes are guarded by
	attempts int    // failed attempts before this claim
	fanout   int64  // fanout_id of a fan-out child, 0 for others
	priority int    // the row's priority when claimed: workers get a claim's rows in (priority, id) order
	key      string // concurrency_key, if keyed
	keyed    bool   // the row has a concurrency_key: counted in keyLoad while in a worker's queue

	forgotten bool // a reconcile found its row no longer our claim: no write of ours applies
	// cancelled: an operator cancelled it while it was running (operate.go); its failure, if
	// the stage reports one, is not written (the guarded write would change nothing anyway).
	cancelled bool
	// writeHeld: its failure or reset write found the row held by another transaction and
	// waits for it (retry.go); said once, not at every attempt. Also a failure write the
	// database refused for this row alone, or not tried in its round (writeFailuresAlone).
	writeHeld bool
	// writeRefused: the database refused its failure write by itself; said once.
	writeRefused bool
}

// worker is one worker process of a stage.
type worker struct {
	id    int    // unique within this dispatcher run; keys its timers
	stage string // the stage it serves
	gen   int    // the pool generation it was started for; a reload bumps it
	pid   int
	cmd   *exec.Cmd
	stdin *os.File

	queue  []*message // in flight, head first
	headAt time.Time  // when queue[0] became the head (MAX_RUNTIME counts from here)
	sent   int        // messages written to it (MAX_MESSAGES)
	// limit is the most ids in flight to it: QUEUE_LIMIT, or fewer when its stdin pipe cannot
	// hold that many (pipeLimit), so that the loop's write never waits for the worker.
	limit     int
	answered  int  // status lines read
	isolating bool // it runs a suspect alone and takes nothing more until it answers (suspects.go)
	// readAtKill: how many of its queue it had read when the watchdog killed it (-1: not told).
	readAtKill int
	// fusable: the stages of the PEPSI_FUSE it was started with, which it may report as
	// fused (its pool's, shared, read only); fusedIgnored: a report it made otherwise was logged.
	fusable      map[string]bool
	fusedIgnored bool
	idleSince    time.Time
	state        workerState
	fate         workerFate
	started      time.Time
}

// workerReplies carries status lines read from a worker. Lines read in one go travel
// together, so a batch of replies costs one channel send.
type workerReplies struct {
	w     *worker
	lines []string
	err   error // a line that could not be read (too long, or not UTF-8 safe); ends the batch
}

// workerExit says a worker process has exited and all its output was read.
type workerExit struct {
	w     *worker
	state *os.ProcessState // nil if Wait itself failed
	err   error
	// signs: what its standard error said of its database session (logLoop).
	signs stderrSigns
}

// stderrSigns is what a worker's standard error said of its database session.
type stderrSigns struct {
	// outage: its session was cut or refused by a failover (isOutageText): its death is the
	// outage's, not its message's.
	outage bool
	// noSession: the server would not give it a session (isNoSessionText): a worker that dies
	// of that at its start never ran its head message, so the head is not the message that
	// kills the stage's workers (supervise.go).
	noSession bool
}

// startWorker starts PROGRAM for stage s. The replies and the exit are sent to events; the
// goroutines are tracked by wg and give up sending when ctx ends.
func startWorker(ctx context.Context, wg *sync.WaitGroup, events chan<- event, log *slog.Logger,
	id int, s *StageConfig, gen int, env []string, configFile string, budget *stderrBudget) (*worker, error) {
	args := []string{}
	if configFile != "" {
		args = append(args, "-c", configFile)
	}
	args = append(args, "worker")
	cmd := exec.Command(s.Program, args...)
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid:   true,            // a kill of -pid reaches the worker's own children too
		Pdeathsig: syscall.SIGKILL, // it dies with us: a worker must never outlive its dispatcher
	}
	// Our own pipes rather than cmd.StdoutPipe: Wait must not close stdout under the reader,
	// and the parent-side ends are plain files we close when we choose.
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("start worker of stage %s: stdin pipe: %w", s.Name, err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, fmt.Errorf("start worker of stage %s: stdout pipe: %w", s.Name, err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		outR.Close()
		outW.Close()
		return nil, fmt.Errorf("start worker of stage %s: stderr pipe: %w", s.Name, err)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, errW
	err = cmd.Start()
	// The child has its copies now; ours of the child's ends must go, or EOF never comes.
	inR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		errR.Close()
		return nil, fmt.Errorf("start worker of stage %s: %w", s.Name, startFailure(s.Program, err))
	}
	w := &worker{id: id, readAtKill: -1, stage: s.Name, gen: gen, pid: cmd.Process.Pid, cmd: cmd, stdin: inW,
		started: time.Now(), idleSince: time.Now(), limit: pipeLimit(inW, s.QueueLimit)}
	wlog := log.With("stage", s.Name, "pid", w.pid)
	readDone := make(chan struct{})
	logDone := make(chan struct{})
	wg.Add(3)
	go func() { defer wg.Done(); defer close(readDone); w.readLoop(ctx, outR, events) }()
	var signs stderrSigns // written by logLoop's goroutine, read by waitLoop's after logDone
	go func() { defer wg.Done(); defer close(logDone); signs = logLoop(errR, wlog, budget) }()
	go func() { defer wg.Done(); w.waitLoop(ctx, events, readDone, logDone, outR, errR, &signs) }()
	return w, nil
}

// startFailure adds what the kernel's answer leaves out when PROGRAM does not start: execve
// says "no such file or directory" for a file that exists when the interpreter its #! line
// names does not, which a line saved with Windows line ends makes of any interpreter
// ("/bin/sh\r"), and "exec format error" for a script without a #! line, which a shell would
// have run. Only the failure path reads the file's first line.
func startFailure(program string, err error) error {
	if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, syscall.ENOEXEC) {
		return err
	}
	f, oerr := os.Open(program)
	if oerr != nil {
		return err // it is the file that is missing, or unreadable to us
	}
	defer f.Close()
	head := make([]byte, 256)
	n, _ := io.ReadFull(f, head)
	line, _, _ := bytes.Cut(head[:n], []byte("\n"))
	shebang, isScript := bytes.CutPrefix(line, []byte("#!"))
	switch {
	case errors.Is(err, syscall.ENOEXEC) && !isScript:
		return fmt.Errorf("%w: a script needs a #! line naming its interpreter", err)
	case !errors.Is(err, fs.ErrNotExist):
		return err
	case isScript && bytes.HasSuffix(shebang, []byte("\r")):
		return fmt.Errorf("%w: the file exists, but its #! line ends in a carriage return, "+
			"which the kernel takes as part of the interpreter's name (the file has Windows line ends: convert it, e.g. with dos2unix)", err)
	case isScript && len(bytes.Fields(shebang)) > 0:
		return fmt.Errorf("%w: the file exists; the interpreter its #! line names, %q, does not", err, bytes.Fields(shebang)[0])
	case bytes.HasPrefix(head[:n], []byte("\x7fELF")):
		return fmt.Errorf("%w: the file exists; the dynamic loader it was built for does not (a program built for another system?)", err)
	}
	return err
}

// readLoop reads status lines until EOF, sending each burst of complete lines as one event.
func (w *worker) readLoop(ctx context.Context, out *os.File, events chan<- event) {
	r := bufio.NewReaderSize(out, 16<<10)
	for {
		var lines []string
		line, err := readReplyLine(r)
		if err == nil {
			lines = append(lines, line)
			// Take every further line already buffered, so a pipelined batch is one event.
			for err == nil && bytes.IndexByte(peekBuffered(r), '\n') >= 0 {
				line, err = readReplyLine(r)
				if err == nil {
					lines = append(lines, line)
				}
			}
		}
		if err == io.EOF {
			err = nil
			if len(lines) == 0 {
				return
			}
		}
		select {
		case events <- workerReplies{w: w, lines: lines, err: err}:
		case <-ctx.Done():
			return
		}
		if err != nil {
			// The coordinator kills a worker that broke the protocol; drain until EOF so the
			// worker is never blocked on a full pipe while it dies.
			io.Copy(io.Discard, out)
			return
		}
	}
}

func peekBuffered(r *bufio.Reader) []byte {
	b, _ := r.Peek(r.Buffered())
	return b
}

// errReplyTooLong is a status line over replyMaxLine bytes.
var errReplyTooLong = fmt.Errorf("status line longer than %d bytes", replyMaxLine)

// readReplyLine reads one '\n'-terminated line without its terminator (and without a '\r'
// before it). A final line without '\n' at EOF still counts: the process wrote it.
func readReplyLine(r *bufio.Reader) (string, error) {
	var buf []byte
	for {
		frag, err := r.ReadSlice('\n')
		if len(buf)+len(frag) > replyMaxLine+1 {
			return "", errReplyTooLong
		}
		buf = append(buf, frag...)
		switch {
		case err == nil:
			buf = buf[:len(buf)-1]
			buf = bytes.TrimSuffix(buf, []byte{'\r'})
			return string(buf), nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case err == io.EOF && len(buf) > 0:
			return string(bytes.TrimSuffix(buf, []byte{'\r'})), nil
		default:
			return "", err
		}
	}
}

// waitLoop waits for the process to exit and for its output to be read, then reports the exit.
func (w *worker) waitLoop(ctx context.Context, events chan<- event, readDone, logDone <-chan struct{}, outR, errR *os.File, signs *stderrSigns) {
	err := w.cmd.Wait()
	// Wait returns when the process exits; its stdout may still hold replies we must deliver
	// before the exit, and a grandchild may hold the pipes open: kill the group, then force EOF.
	t := time.NewTimer(exitReadGrace)
	select {
	case <-readDone:
	case <-t.C:
		syscall.Kill(-w.pid, syscall.SIGKILL)
		outR.Close() // unblocks the reader with an error instead of EOF
		<-readDone
	}
	t.Reset(exitReadGrace)
	select {
	case <-logDone:
	case <-t.C:
		syscall.Kill(-w.pid, syscall.SIGKILL)
		errR.Close()
		<-logDone
	}
	t.Stop()
	outR.Close()
	errR.Close()
	var state *os.ProcessState
	var exitErr *exec.ExitError
	if err == nil || errors.As(err, &exitErr) {
		state, err = w.cmd.ProcessState, nil
	}
	select {
	case events <- workerExit{w: w, state: state, err: err, signs: *signs}:
	case <-ctx.Done():
	}
}

// logLoop copies the worker's standard error to the log, one record per line, and reports
// whether a line named a database outage or a session the server refused (a stage that lost
// its session, or could not make it, says why, then exits). A line longer than stderrLineMax
// is logged cut, with the bytes cut, and the reading goes on: a bufio.Scanner stops at its
// first line over its buffer, and every later line of that worker went unlogged, its last
// words and its session's refusal among them (TestLogLoopLongLine).
func logLoop(errR *os.File, log *slog.Logger, budget *stderrBudget) (signs stderrSigns) {
	r := bufio.NewReaderSize(errR, 4096)
	var buf []byte
	for {
		line, cut, err := readLogLine(r, buf[:0], stderrLineMax)
		buf = line
		if err != nil {
			// EOF, or the pipe closed under us (waitLoop's grace): nothing more to log.
			return signs
		}
		text := string(line)
		signs.outage = signs.outage || isOutageText(text)
		signs.noSession = signs.noSession || isNoSessionText(text)
		left, first, ok := budget.admit(time.Now())
		if left > 0 {
			log.Warn("worker stderr: lines of this stage's workers were left out", "lines", left)
		}
		if first {
			log.Warn("worker stderr: this stage's workers wrote more than "+strconv.Itoa(stderrLinesPerWindow)+
				" lines in "+stderrWindow.String()+"; the rest of them are left out, and counted",
				"window", stderrWindow)
		}
		if !ok {
			continue
		}
		if cut > 0 {
			log.Warn("worker stderr", "line", text, "cut_bytes", cut)
		} else {
			log.Warn("worker stderr", "line", text)
		}
	}
}

// stderrBudget is how many standard-error lines of one stage's workers the log takes:
// stderrLinesPerWindow per stderrWindow, the rest counted and said. A stage that printed a line
// per message at thousands a second made the daemon's log that busy, and journald's rate limit
// (10,000 messages in 30 s per service, by default) then dropped lines of the dispatcher's own
// with them (TestLogLoopFlood). Every line is still read for its signs. One per stage, shared
// by its workers' logLoop goroutines.
type stderrBudget struct {
	mu     sync.Mutex
	window time.Time // the start of the current window
	lines  int       // lines in the window, logged or not
	left   int       // lines left out and not yet said
}

const (
	stderrLinesPerWindow = 1000
	stderrWindow         = 10 * time.Second
)

// admit counts a line at now and reports whether it is logged (ok), whether it is the first
// one left out in its window (first: say that lines are being left out), and how many lines
// left out before it are to be said now (left: at the first line of a new window).
func (b *stderrBudget) admit(now time.Time) (left int, first, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Sub(b.window) >= stderrWindow {
		b.window, b.lines = now, 0
		left, b.left = b.left, 0
	}
	b.lines++
	if b.lines <= stderrLinesPerWindow {
		return left, false, true
	}
	b.left++
	return left, b.lines == stderrLinesPerWindow+1, false
}

// stderrLineMax bounds one record of a worker's standard error: a handler that prints a whole
// payload, or a program that writes binary, cannot make one record of megabytes.
const stderrLineMax = 64 << 10

// readLogLine appends to buf one line of r without its '\n' (nor a '\r' before it), at most
// limit bytes of it, and says how many bytes past limit it dropped. A last line without '\n'
// counts; err is r's error (io.EOF at the end), once no byte of a line is left.
func readLogLine(r *bufio.Reader, buf []byte, limit int) (line []byte, cut int, err error) {
	read := 0
	for {
		var frag []byte
		frag, err = r.ReadSlice('\n')
		read += len(frag)
		keep := min(len(frag), max(0, limit-len(buf)))
		buf = append(buf, frag[:keep]...)
		cut += len(frag) - keep
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if read == 0 {
			return buf, 0, err
		}
		if err == nil {
			// frag ended with the '\n': it is the last byte kept, or the last one cut.
			if cut > 0 {
				cut--
			} else {
				buf = buf[:len(buf)-1]
			}
		}
		if cut == 0 {
			buf = bytes.TrimSuffix(buf, []byte{'\r'})
		}
		return buf, cut, nil // an error after a last line comes again at the next call
	}
}

// send writes the ids of msgs to the worker's stdin in one write. It never blocks for long:
// at most w.limit ids are in flight to it, and they fit in its pipe (pipeLimit).
func (w *worker) send(msgs []*message, buf []byte) ([]byte, error) {
	buf = buf[:0]
	for _, m := range msgs {
		buf = strconv.AppendInt(buf, m.id, 10)
		buf = append(buf, '\n')
	}
	_, err := w.stdin.Write(buf)
	return buf, err
}

// maxIDLine is the longest line of an id on a worker's stdin: a bigint's sign, 19 digits and LF.
const maxIDLine = 21

// pipeLimit is how many ids a worker may have in flight, QUEUE_LIMIT at most: as many as its
// stdin pipe f holds at their longest. The loop writes a worker's ids on its own goroutine,
// and a write to a full pipe waits until the worker reads, which a worker running a long
// message does only once it is done: meanwhile no stage would be claimed, no timer served.
// A pipe holds 64 KiB, 3,120 ids, above QUEUE_LIMIT's maximum (queueLimitMax); but once a
// user has 1,024 pipes open, Linux gives its further ones 8 KiB (pipe-user-pages-soft, for a
// user without CAP_SYS_RESOURCE, as the dispatcher is after dropping its privileges): 390
// ids (TestSmallPipeNeverBlocks). Should the size not be known, QUEUE_LIMIT stands.
func pipeLimit(f *os.File, queueLimit int) int {
	size, err := pipeSize(f)
	if err != nil || size <= 0 {
		return queueLimit
	}
	return max(1, min(queueLimit, size/maxIDLine))
}

// fGetPipeSize is Linux's F_GETPIPE_SZ, which the syscall package does not name.
const fGetPipeSize = 1032

// pipeUnread returns the bytes written to the pipe of f (either end) and not read yet (FIONREAD).
func pipeUnread(f *os.File) (int, error) {
	return onFD(f, func(fd uintptr) (int, syscall.Errno) {
		var n int32
		_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCINQ, uintptr(unsafe.Pointer(&n)))
		return int(n), errno
	})
}

// pipeSize returns how many bytes the pipe of f holds (F_GETPIPE_SZ).
func pipeSize(f *os.File) (int, error) {
	return onFD(f, func(fd uintptr) (int, syscall.Errno) {
		n, _, errno := syscall.Syscall(syscall.SYS_FCNTL, fd, fGetPipeSize, 0)
		return int(n), errno
	})
}

// onFD runs call on f's descriptor, without taking it out of the runtime's poller as Fd would.
func onFD(f *os.File, call func(fd uintptr) (int, syscall.Errno)) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var errno syscall.Errno
	if err := rc.Control(func(fd uintptr) { n, errno = call(fd) }); err != nil {
		return 0, err
	}
	if errno != 0 {
		return 0, errno
	}
	return n, nil
}

// closeStdin tells the worker that no more ids will come: it finishes its queue and exits.
func (w *worker) closeStdin() {
	if w.stdin != nil {
		w.stdin.Close() // the only error is "already closed", which cannot happen: we nil it
		w.stdin = nil
	}
}

// kill ends the worker's whole process group at once.
func (w *worker) kill() {
	w.closeStdin()
	// ESRCH (already gone) is the only expected error, and then there is nothing to do.
	syscall.Kill(-w.pid, syscall.SIGKILL)
}

// exitReason describes how a process ended, for dispatch_error and the log.
func exitReason(st *os.ProcessState, err error) string {
	if st == nil {
		return fmt.Sprintf("worker lost: %v", err)
	}
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return fmt.Sprintf("worker killed by signal %d (%s)", int(ws.Signal()), ws.Signal())
	}
	return fmt.Sprintf("worker exited with status %d", st.ExitCode())
}

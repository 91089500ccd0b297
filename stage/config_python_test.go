// config_python_test.go: the Go SDK's LoadConfig and the Python SDK's load_config
// (../python/pepsi_stage.py) read the same command line and environment the same way: a
// COMMAND or environment that starts a stage written in one language starts one written in
// the other, and what one refuses the other refuses. Each input goes to both; the Python side
// is one python3 process answering a JSON line per input, so the fuzzer can compare too.

package stage

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"pepsi-dispatch/internal/pgtest"
)

// pyLoadConfig is the Python side: reads {"args": [...], "env": {...}} per line, answers
// {"cfg": {...}} or {"err": "..."} (a ValueError, the SDK's documented refusal) or
// {"crash": "..."} (anything else, which is a bug); and for ids_python_test.go reads
// {"id_line": base64}, answers {"id": "N"} or {"id": null} (refused).
const pyLoadConfig = `
import base64, json, sys, traceback
import pepsi_stage
for line in sys.stdin:
    q = json.loads(line)
    if "id_line" in q:  # ids_python_test.go: one line of a stage's standard input
        try:
            n = pepsi_stage._parse_id(base64.b64decode(q["id_line"]))
            out = {"id": None if n is None else str(n)}
        except Exception:
            out = {"crash": traceback.format_exc()}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        continue
    try:
        c = pepsi_stage.load_config(q["args"], q["env"])
        out = {"cfg": {"stage": c.stage, "next": c.next, "dsn": c.dsn, "config_file": c.config_file,
                       "max_children": c.max_children, "min_span": c.min_span, "fuse": c.fuse}}
    except ValueError as e:
        out = {"err": str(e)}
    except Exception:
        out = {"crash": traceback.format_exc()}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
`

type pyConfig struct {
	Stage       string              `json:"stage"`
	Next        []string            `json:"next"`
	DSN         string              `json:"dsn"`
	ConfigFile  string              `json:"config_file"`
	MaxChildren int                 `json:"max_children"`
	MinSpan     int64               `json:"min_span"`
	Fuse        map[string][]string `json:"fuse"`
}

type pyAnswer struct {
	ID    *string   `json:"id"` // an id line's id in decimal, nil when refused
	Cfg   *pyConfig `json:"cfg"`
	Err   string    `json:"err"`
	Crash string    `json:"crash"`
}

// pySDK is one python3 process running pyLoadConfig, shared by a test binary's tests and fuzz
// inputs (a fuzzing worker is a process of its own, with its own). It exits when the test
// binary does (its standard input closes).
type pySDK struct {
	mu  sync.Mutex
	in  io.Writer
	out *bufio.Reader
}

var (
	pyOnce sync.Once
	pyProc *pySDK
	pyErr  error
)

// pythonAndSDK is the interpreter the tests run Python with (pgtest.Python) and the directory
// of the Python SDK, for PYTHONPATH.
func pythonAndSDK() (python, dir string, err error) {
	dir, err = filepath.Abs("../python")
	if err != nil {
		return "", "", fmt.Errorf("find the Python SDK (../python): %w", err)
	}
	return pgtest.Python(), dir, nil
}

func pythonSDK(t testing.TB) *pySDK {
	t.Helper()
	pyOnce.Do(func() {
		python, dir, err := pythonAndSDK()
		if err != nil {
			pyErr = err
			return
		}
		cmd := exec.Command(python, "-c", pyLoadConfig)
		cmd.Env = append(os.Environ(), "PYTHONPATH="+dir, "PYTHONIOENCODING=utf-8")
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			pyErr = fmt.Errorf("pipe to %s: %w", python, err)
			return
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			pyErr = fmt.Errorf("pipe from %s: %w", python, err)
			return
		}
		if err := cmd.Start(); err != nil {
			pyErr = fmt.Errorf("start %s with the Python SDK (python/): %w", python, err)
			return
		}
		pyProc = &pySDK{in: in, out: bufio.NewReaderSize(out, 1<<16)}
	})
	if pyErr != nil {
		t.Fatal(pyErr)
	}
	return pyProc
}

func (p *pySDK) load(t testing.TB, args []string, env map[string]string) pyAnswer {
	t.Helper()
	return p.ask(t, map[string]any{"args": args, "env": env})
}

// ask sends one query and returns the answer.
func (p *pySDK) ask(t testing.TB, query map[string]any) pyAnswer {
	t.Helper()
	q, err := json.Marshal(query)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, err := p.in.Write(append(q, '\n')); err != nil {
		t.Fatalf("write to python3: %v", err)
	}
	line, err := p.out.ReadBytes('\n')
	if err != nil {
		t.Fatalf("read from python3 (for %s): %v", q, err)
	}
	var a pyAnswer
	if err := json.Unmarshal(line, &a); err != nil {
		t.Fatalf("python3 answered %q: %v", line, err)
	}
	return a
}

// sameConfig checks one input against both SDKs: both refuse it, or both accept it and read
// the same configuration.
func sameConfig(t testing.TB, py *pySDK, args []string, env map[string]string) {
	t.Helper()
	cfg, err := loadConfig(args, func(k string) string { return env[k] })
	a := py.load(t, args, env)
	switch {
	case a.Crash != "":
		t.Errorf("args %q env %q: Python raised other than ValueError:\n%s", args, env, a.Crash)
	case err != nil && a.Cfg != nil:
		t.Errorf("args %q env %q: Go refuses (%v), Python accepts: %+v", args, env, err, *a.Cfg)
	case err == nil && a.Cfg == nil:
		t.Errorf("args %q env %q: Python refuses (%s), Go accepts: %+v", args, env, a.Err, cfg)
	case err != nil:
		if a.Err == "" {
			t.Errorf("args %q env %q: Python refuses with an empty message", args, env)
		}
	default:
		p := a.Cfg
		fuseSame := len(p.Fuse) == len(cfg.Fuse)
		for k, v := range cfg.Fuse {
			w, ok := p.Fuse[k]
			fuseSame = fuseSame && ok && slices.Equal(v, w)
		}
		if p.Stage != cfg.Stage || !slices.Equal(p.Next, cfg.Next) || p.DSN != cfg.DSN ||
			p.ConfigFile != cfg.ConfigFile || p.MaxChildren != cfg.MaxChildren || p.MinSpan != cfg.MinSpan || !fuseSame {
			t.Errorf("args %q env %q: Go reads %+v, Python %+v", args, env, cfg, *p)
		}
	}
}

// configEnv is a valid environment to vary one variable of.
func configEnv() map[string]string {
	return map[string]string{"PEPSI_STAGE": "parse", "PEPSI_NEXT": "enrich deliver", "PEPSI_DSN": "host=/x",
		"PEPSI_FUSE": "enrich=deliver deliver=", "PEPSI_MAX_CHILDREN": "100", "PEPSI_MIN_SPAN": "10"}
}

// configCases are the inputs on which the two SDKs once disagreed, and their neighbours.
var configCases = []struct {
	args []string
	key  string // "" leaves the environment valid
	val  string
}{
	{[]string{"worker"}, "", ""},
	{[]string{"-c", "/etc/pepsi.conf", "worker"}, "", ""},
	{[]string{"-c=/etc/pepsi.conf", "worker"}, "", ""},
	{[]string{"--c", "/etc/pepsi.conf", "worker"}, "", ""},
	{[]string{"--c=", "worker"}, "", ""},
	{[]string{"-c", "a", "-c", "b", "worker"}, "", ""},
	{[]string{"-c/etc/pepsi.conf", "worker"}, "", ""},
	{[]string{"-c", "a", "--", "worker"}, "", ""},
	{[]string{"--", "worker"}, "", ""},
	{[]string{"-", "worker"}, "", ""},
	{[]string{"---c", "a", "worker"}, "", ""},
	{[]string{"-=c", "worker"}, "", ""},
	{[]string{"-h", "worker"}, "", ""},
	{[]string{"-c"}, "", ""},
	{[]string{"worker", "-c", "a"}, "", ""},
	{[]string{}, "", ""},
	{[]string{"worker"}, "PEPSI_STAGE", "parse\n"},
	{[]string{"worker"}, "PEPSI_STAGE", " parse"},
	{[]string{"worker"}, "PEPSI_STAGE", ""},
	{[]string{"worker"}, "PEPSI_NEXT", "enrich\x1cdeliver"},
	{[]string{"worker"}, "PEPSI_NEXT", "enrich\u00a0deliver\u3000"},
	{[]string{"worker"}, "PEPSI_NEXT", "enrich\n"},
	{[]string{"worker"}, "PEPSI_NEXT", ""},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich=deliver,,archive"},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich=deliver,"},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich=deliver\x1fdeliver="},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich=deliver\u2028deliver="},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich\n=deliver"},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich=deliver\n"},
	{[]string{"worker"}, "PEPSI_FUSE", "=deliver"},
	{[]string{"worker"}, "PEPSI_FUSE", "enrich="},
	{[]string{"worker"}, "PEPSI_FUSE", " "},
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "+5"},
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "-0"},
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "0005"},
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "\u0663"}, // ARABIC-INDIC DIGIT THREE
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "\u00b2"}, // SUPERSCRIPT TWO
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "2147483647"},
	{[]string{"worker"}, "PEPSI_MAX_CHILDREN", "2147483648"},
	{[]string{"worker"}, "PEPSI_MIN_SPAN", " 5"},
	{[]string{"worker"}, "PEPSI_MIN_SPAN", "1_000"},
	{[]string{"worker"}, "PEPSI_MIN_SPAN", "5\n"},
	{[]string{"worker"}, "PEPSI_DSN", ""},
}

func TestConfigSameInPython(t *testing.T) {
	py := pythonSDK(t)
	for _, c := range configCases {
		env := configEnv()
		if c.key != "" {
			env[c.key] = c.val
		}
		sameConfig(t, py, c.args, env)
	}
	if t.Failed() {
		return
	}
	// And random variations, from a fixed seed, of the variables made of the characters the
	// readers treat differently if they disagree on anything.
	alphabet := []string{"a", "z", "0", "9", "_", "-", "=", ",", " ", "\t", "\n", "\v", "\x1c", "\x1f",
		"\u0085", "\u00a0", "\u2028", "\u3000", "+", "A", "\u0663", "\u00b2", "c", "worker", "--"}
	rng := rand.New(rand.NewSource(23))
	word := func() string {
		var b strings.Builder
		for n := rng.Intn(6); n > 0; n-- {
			b.WriteString(alphabet[rng.Intn(len(alphabet))])
		}
		return b.String()
	}
	keys := []string{"PEPSI_STAGE", "PEPSI_NEXT", "PEPSI_FUSE", "PEPSI_MAX_CHILDREN", "PEPSI_MIN_SPAN", "PEPSI_DSN"}
	for i := 0; i < 5000 && !t.Failed(); i++ {
		env := configEnv()
		env[keys[rng.Intn(len(keys))]] = word()
		args := []string{"worker"}
		if rng.Intn(4) == 0 {
			args = []string{word(), word(), "worker"}[rng.Intn(3):]
		}
		sameConfig(t, py, args, env)
	}
}

// FuzzConfigSameInPython: the same comparison on what the fuzzer makes of one variable and
// the command line (its arguments separated by NUL, which no argument can hold).
func FuzzConfigSameInPython(f *testing.F) {
	keys := []string{"PEPSI_STAGE", "PEPSI_NEXT", "PEPSI_FUSE", "PEPSI_MAX_CHILDREN", "PEPSI_MIN_SPAN"}
	for _, c := range configCases {
		k := slices.Index(keys, c.key)
		if k < 0 {
			k = 2
		}
		f.Add(uint8(k), c.val, strings.Join(c.args, "\x00"))
	}
	f.Fuzz(func(t *testing.T, key uint8, val, args string) {
		if !utf8.ValidString(val) || !utf8.ValidString(args) || strings.ContainsRune(val, 0) {
			return // an environment holds no NUL, and JSON carries only UTF-8 to Python
		}
		env := configEnv()
		env[keys[int(key)%len(keys)]] = val
		sameConfig(t, pythonSDK(t), strings.Split(args, "\x00"), env)
	})
}

// conf_daemon_test.go: configuration mistakes, the password and the privilege drop, as the
// real daemon reports them (issue 17 D2–D7, issue 22): exit status, the one message, the log.

package main

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"
)

// runDaemonOnce runs `pepsi-dispatch args… serve` to its end and returns status and output.
func runDaemonOnce(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append(args, "serve")...)
	cmd.Env = append(append(os.Environ(), "PEPSI_TEST_DAEMON=1"), env...)
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		<-done
		t.Fatalf("%v: still running after 30 s (a mistake must end the start):\n%s", args, out)
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatalf("%v: %v", args, err)
	}
	return 0, string(out)
}

// TestDaemonConfigMistakes: each mistake ends the start with status 2 and one message naming
// file, line and key; the message is printed once, carries no raw control byte, and no
// password.
func TestDaemonConfigMistakes(t *testing.T) {
	const pw = "s3cretPW"
	dir := testDir(t)
	const nobody = "[pepsi-dispatch]\nUSER = nobody\n" // so that a DSN the loader takes is tried
	cases := []struct {
		name, text, want string
	}{
		{"URL with a bad host", "[database]\nDSN = postgres://pepsi:" + pw + "@[bad/mail\n" + nobody, "c.conf:2: DSN: not a valid postgres:// URL: missing ']' in host"},
		{"URL with a bad port", "[database]\nDSN = postgres://pepsi:" + pw + "@db1:abc/mail\n" + nobody, `c.conf:2: DSN: not a valid postgres:// URL: invalid port ":abc" after host`},
		{"port=abc", "[database]\nDSN = host=db1 port=abc password=" + pw + "\n" + nobody, `c.conf:2: DSN: wrong value for "port"`},
		{"sslmode=bogus", "[database]\nDSN = host=db1 sslmode=bogus\n" + nobody, `c.conf:2: DSN: wrong value for "sslmode": "bogus" is not supported`},
		{"unterminated quote", "[database]\nDSN = host=db1 dbname='mail\n" + nobody, "c.conf:2: DSN: unterminated quoted string literal"},
		{"LISTEN port", "[poolcounter]\nLISTEN = 127.0.0.1:99999\n", `c.conf:2: LISTEN: want host:port`},
		{"LISTEN negative port", "[poolcounter]\nLISTEN = :-1\n", `c.conf:2: LISTEN: want host:port`},
		{"LISTEN five octets", "[poolcounter]\nLISTEN = 1.2.3.4.5:80\n", `c.conf:2: LISTEN: want host:port`},
		{"METRICS_LISTEN comment", "[pepsi-dispatch]\nMETRICS_LISTEN = 127.0.0.1:9187 # metrics\n", "c.conf:2: METRICS_LISTEN: want host:port"},
		{"long line", "[pepsi-dispatch]\n# " + strings.Repeat("x", iniMaxLine) + "\n", "c.conf:2: line longer than 65536 bytes"},
		{"binary file", "\x7fELF\x02\x01\x01\x00\x1b[2J\x1b]0;title\x07=\x00\x00", `c.conf:1: "\x7fELF`},
		{"NUL in a value", "[pepsi-dispatch]\nUSER = nob\x00ody\n", "c.conf:2: USER: the value contains the control character U+0000"},
		{"empty file", "", "c.conf: nothing to run"},
	}
	if os.Geteuid() == 0 {
		cases = append(cases, struct{ name, text, want string }{"missing USER",
			"[poolcounter]\nLISTEN = 127.0.0.1:0\n[pepsi-dispatch]\nUSER = no-such-account-here\n",
			`c.conf: USER: started as root, but account "no-such-account-here" does not exist`})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := writeFile(t, dir, "c.conf", tc.text)
			st, out := runDaemonOnce(t, nil, "-c", p)
			out = strings.ReplaceAll(out, dir+"/", "")
			if st != 2 {
				t.Errorf("exit %d, want 2:\n%s", st, out)
			}
			if n := strings.Count(out, tc.want); n != 1 {
				t.Errorf("%q printed %d times, want once:\n%s", tc.want, n, out)
			}
			if strings.Contains(out, "level=ERROR") {
				t.Errorf("the mistake is reported twice (plain and as an ERROR record):\n%s", out)
			}
			if i := strings.IndexFunc(out, func(r rune) bool { return unicode.IsControl(r) && r != '\n' }); i >= 0 {
				t.Errorf("raw control character %q in the output:\n%q", out[i], out)
			}
			if strings.Contains(out, pw) || strings.Contains(out, "application_name") {
				t.Errorf("output shows the password or blames application_name:\n%s", out)
			}
		})
	}
	t.Run("directory", func(t *testing.T) {
		st, out := runDaemonOnce(t, nil, "-c", dir)
		if want := "pepsi-dispatch: " + dir + ": is a directory; -c names the configuration file\n"; st != 2 || out != want {
			t.Errorf("exit %d, output %q; want 2, %q", st, out, want)
		}
	})
}

// scramRole makes a login role with a password that the private cluster checks (scram-sha-256
// for this role only, ahead of the trust lines), and returns its name; both go after t.
func scramRole(t *testing.T, s *testSchema, password string) string {
	t.Helper()
	if testPG.Dir() == "" {
		t.Skip("needs the private cluster (its pg_hba.conf): PEPSI_TEST_DSN is set")
	}
	role := strings.ReplaceAll(s.Name, "t_", "pw_")
	hba := filepath.Join(testPG.Dir(), "data", "pg_hba.conf")
	orig, err := os.ReadFile(hba)
	if err != nil {
		t.Fatal(err)
	}
	s.exec(t, fmt.Sprintf(`CREATE ROLE %s LOGIN SUPERUSER PASSWORD '%s'`, role, password))
	lines := fmt.Sprintf("local all %[1]s scram-sha-256\nhost all %[1]s 127.0.0.1/32 scram-sha-256\n", role)
	if err := os.WriteFile(hba, append([]byte(lines), orig...), 0o600); err != nil {
		t.Fatal(err)
	}
	s.exec(t, `SELECT pg_reload_conf()`)
	t.Cleanup(func() {
		os.WriteFile(hba, orig, 0o600)
		s.DB.Exec(`SELECT pg_reload_conf()`)
		s.DB.Exec(`DROP ROLE IF EXISTS ` + role)
	})
	// The reload is asynchronous: wait until a wrong password is refused.
	wrong := withUser(s.DSN, role, "not-"+password)
	waitFor(t, 30*time.Second, "pg_hba.conf reloaded", func() bool {
		db, err := sql.Open("postgres", wrong)
		if err != nil {
			return false
		}
		defer db.Close()
		err = db.Ping()
		return err != nil && strings.Contains(err.Error(), "password authentication failed")
	})
	return role
}

// withUser returns the key=value dsn with user and password set (later keys win).
func withUser(dsn, user, password string) string {
	return fmt.Sprintf("%s user=%s password='%s'", dsn, user, password)
}

// TestPasswordNeverLogged (D2): the whole log of a run of scenarios (bad DSNs, a server that is
// not there, a wrong password, a dispatcher that works, reloads, /metrics) has no password in
// it, whether it came in the DSN (either form) or in PGPASSWORD.
func TestPasswordNeverLogged(t *testing.T) {
	const pw = "Pw-s3cret-0613"
	s := newTestSchema(t)
	s.exec(t, runsDDL)
	role := scramRole(t, s, pw)
	var all strings.Builder
	record := func(name, out string) { fmt.Fprintf(&all, "==== %s\n%s\n", name, out) }

	// Bad DSNs: configuration errors.
	for i, dsn := range []string{
		"postgres://pepsi:" + pw + "@[bad/mail", "postgres://pepsi:" + pw + "@db1:abc/mail",
		"host=db1 port=abc password=" + pw, "host=db1 password='" + pw, "password=" + pw + " half dbname=x",
		"postgres://pepsi@db1/mail?password=" + pw + "&sslmode=bogus",
	} {
		d := startDaemon(t, "[database]\nDSN = "+dsn+"\n[pepsi-dispatch]\nUSER = nobody\n", "")
		waitFor(t, 30*time.Second, "an exit, or a wait for the database", func() bool {
			select {
			case <-d.done:
				return true
			default:
				return strings.Contains(d.log.String(), "waiting for it")
			}
		})
		select {
		case <-d.done:
			if d.status != 2 {
				t.Errorf("DSN %d: exit %d, want 2", i, d.status)
			}
		default:
			t.Errorf("DSN %d: the daemon waits for a database instead of exiting 2", i)
			d.cmd.Process.Kill()
			<-d.done
		}
		record("bad DSN", d.log.String())
	}

	// A server that is not there: the daemon waits (and says so), then stops on SIGTERM.
	free := strings.TrimPrefix(freePort(t), "127.0.0.1:")
	for _, c := range []struct{ dsn, env string }{
		{fmt.Sprintf("host=127.0.0.1 port=%s user=pepsi password=%s sslmode=disable", free, pw), ""},
		{fmt.Sprintf("postgres://pepsi:%s@127.0.0.1:%s/mail?sslmode=disable", pw, free), ""},
		{fmt.Sprintf("host=127.0.0.1 port=%s user=pepsi sslmode=disable", free), "PGPASSWORD=" + pw},
	} {
		conf := strings.Replace(baseConf(s, ""), s.DSN, c.dsn, 1) + stageConf(t, "a", "", "")
		var env []string
		if c.env != "" {
			env = append(env, c.env)
		}
		d := startDaemon(t, conf, "pipeline", env...)
		d.waitLog("database not reachable; waiting for it", 30*time.Second)
		d.stop()
		record("unreachable", d.log.String())
	}

	// A wrong password: fatal, status 1.
	for _, dsn := range []string{withUser(s.DSN, role, pw+"-wrong"), withUser(s.DSN, role, pw) + " password=x" + pw} {
		d := startDaemon(t, strings.Replace(baseConf(s, ""), s.DSN, dsn, 1)+stageConf(t, "a", "", ""), "pipeline")
		if st := d.wait(30 * time.Second); st != 1 {
			t.Errorf("wrong password: exit %d, want 1", st)
		}
		if !strings.Contains(d.log.String(), "password authentication failed") {
			t.Errorf("wrong password: the log does not say so:\n%s", d.log.String())
		}
		record("wrong password", d.log.String())
	}

	// The right password, in the DSN and in PGPASSWORD: messages flow, the graph reloads (file
	// and table), a worker fails a message; /metrics is read.
	addr := freePort(t)
	for i, c := range []struct{ dsn, env string }{
		{withUser(s.DSN, role, pw), ""},
		{s.DSN + " user=" + role, "PGPASSWORD=" + pw},
	} {
		conf := strings.Replace(baseConf(s, "METRICS_LISTEN = "+addr), s.DSN, c.dsn, 1) + stageConf(t, "a", "", "")
		var env []string
		if c.env != "" {
			env = append(env, c.env)
		}
		d := startDaemon(t, conf, "pipeline", env...)
		enqueue(t, s, "a", 5, `{}`)
		enqueue(t, s, "a", 1, `{"fail_at": "a"}`)
		waitFor(t, 30*time.Second, "5 done", func() bool { return countStatus(t, s, "done") == 5 })
		d.waitLog("message failed", 30*time.Second)
		s.exec(t, `INSERT INTO config (section, key, value) VALUES ('stage-a', 'PARALLELISM', $1)`, fmt.Sprint(2+i))
		d.waitLog("stage graph reloaded", 30*time.Second)
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		record("metrics", string(body))
		s.exec(t, `DELETE FROM config`)
		s.exec(t, `DELETE FROM workqueue`)
		d.stop()
		record("working", d.log.String())
	}

	log := all.String()
	for _, frag := range []string{pw, "s3cret", strings.ReplaceAll(pw, "-", "%2D")} {
		if strings.Contains(log, frag) {
			i := strings.Index(log, frag)
			t.Errorf("the log holds %q: …%s…", frag, log[max(0, i-300):min(len(log), i+100)])
		}
	}
	for _, want := range []string{"not a valid postgres:// URL", "database not reachable", "password authentication failed",
		"stage graph reloaded", "message failed", "pepsi_stage_processed_total"} {
		if !strings.Contains(log, want) {
			t.Errorf("the scenarios did not get as far as %q", want)
		}
	}
}

// TestPrivilegeDropEnvironment (issue 22): started as root, the daemon and its workers get
// the service account's HOME, USER and LOGNAME, as runuser(1) gives them, so lib/pq looks
// for client certificates in the account's home, not in /root (which it may not read), and a
// TCP DSN without sslmode connects to a server without SSL as libpq would (prefer).
func TestPrivilegeDropEnvironment(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the dispatcher drops privileges only when started as root")
	}
	if testPG.Dir() == "" {
		t.Skip("needs the private cluster's TCP address")
	}
	s := newTestSchema(t)
	s.exec(t, `CREATE TABLE envs (name text, home text, usr text, logname text)`)
	s.exec(t, `GRANT ALL ON envs TO PUBLIC`)
	tcp := tcpDSN(t, s)
	conf := strings.Replace(baseConf(s, ""), s.DSN, tcp, 1) + stageConf(t, "a", "", "")
	d := startDaemon(t, conf, "env")
	enqueue(t, s, "a", 1, `{}`)
	waitFor(t, 30*time.Second, "the message done", func() bool { return countStatus(t, s, "done") == 1 })
	d.stop()
	var home, usr, logname string
	if err := s.DB.QueryRow(`SELECT home, usr, logname FROM envs`).Scan(&home, &usr, &logname); err != nil {
		t.Fatal(err)
	}
	if home != "/nonexistent" || usr != "nobody" || logname != "nobody" {
		t.Errorf("worker environment HOME=%q USER=%q LOGNAME=%q, want nobody's (/nonexistent, nobody, nobody)", home, usr, logname)
	}
	if strings.Contains(d.log.String(), "database not reachable") {
		t.Errorf("the daemon waited for a reachable database:\n%s", d.log.String())
	}
}

// TestPermissionErrorFatal (issue 22): a file the driver must read but may not (here a client
// certificate in a directory only root may enter) ends the start with a message saying what to
// fix, instead of "database not reachable; waiting for it" forever.
func TestPermissionErrorFatal(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the dispatcher drops privileges only when started as root")
	}
	if testPG.Dir() == "" {
		t.Skip("needs the private cluster's TCP address")
	}
	s := newTestSchema(t)
	private := t.TempDir() // 0700, root's
	if err := os.Chmod(private, 0o700); err != nil {
		t.Fatal(err)
	}
	crt := filepath.Join(private, "client.crt")
	writeFile(t, private, "client.crt", "not a certificate")
	dsn := tcpDSN(t, s) + " sslmode=require sslcert=" + crt
	d := startDaemon(t, strings.Replace(baseConf(s, ""), s.DSN, dsn, 1)+stageConf(t, "a", "", ""), "pipeline")
	if st := d.wait(30 * time.Second); st != 1 {
		t.Fatalf("exit %d, want 1", st)
	}
	log := d.log.String()
	if strings.Contains(log, "database not reachable") {
		t.Errorf("a permission error taken for an unreachable database:\n%s", log)
	}
	for _, want := range []string{"permission denied", crt, "nobody", "make it readable by that account"} {
		if !strings.Contains(log, want) {
			t.Errorf("the message lacks %q:\n%s", want, log)
		}
	}
}

// tcpDSN returns s's DSN over TCP to 127.0.0.1, with no sslmode (the private cluster has no SSL).
func tcpDSN(t *testing.T, s *testSchema) string {
	t.Helper()
	var port string
	if err := s.DB.QueryRow(`SELECT current_setting('port')`).Scan(&port); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("host=127.0.0.1 port=%s user=postgres dbname=postgres options='-c search_path=%s'", port, s.Name)
}

// envWorker records the environment it was started with, then finishes every message.
func envWorker() int {
	db, err := sql.Open("postgres", os.Getenv("PEPSI_DSN"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer db.Close()
	if _, err := db.Exec(`INSERT INTO envs VALUES ($1, $2, $3, $4)`, os.Getenv("PEPSI_STAGE"),
		os.Getenv("HOME"), os.Getenv("USER"), os.Getenv("LOGNAME")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	buf := make([]byte, 64)
	var line []byte
	for {
		n, err := os.Stdin.Read(buf)
		for _, b := range buf[:n] {
			if b != '\n' {
				line = append(line, b)
				continue
			}
			if _, err := db.Exec(`UPDATE workqueue SET status = 'done' WHERE workqueue_id = $1 AND status = 'running'`, string(line)); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			line = line[:0]
			os.Stdout.WriteString("0\n")
		}
		if err != nil {
			return 0
		}
	}
}

func init() { testWorkers["env"] = envWorker }

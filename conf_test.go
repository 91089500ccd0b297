// conf_test.go: the configuration loader against bad input (issue 17, D3–D7): what it
// rejects, where it says the mistake is, and that it never echoes what it should not.

package main

import (
	"os"
	"strings"
	"testing"
	"unicode"
)

// loadErr writes text to c.conf in a fresh directory and returns loadConfig's error with the
// directory cut from it ("" when the file loads).
func loadErr(t *testing.T, text string) string {
	t.Helper()
	dir := testDir(t)
	p := writeFile(t, dir, "c.conf", text)
	_, err := loadConfig(p)
	if err == nil {
		return ""
	}
	if _, ok := err.(*configError); !ok {
		t.Errorf("error of type %T, want *configError: %v", err, err)
	}
	return strings.ReplaceAll(err.Error(), dir+"/", "")
}

// TestConfigListenAddresses (D3): a LISTEN or METRICS_LISTEN that cannot be bound as written
// is a load-time error naming file, line and key.
func TestConfigListenAddresses(t *testing.T) {
	bad := map[string]string{
		"127.0.0.1:99999":          `port "99999" is not a number from 0 to 65535`,
		":-1":                      `port "-1" is not a number`,
		"1.2.3.4.5:80":             `host "1.2.3.4.5" is not an IPv4 address`,
		"127.0.0.1:7531 # comment": "there are no inline comments",
		"127.0.0.1:7531 ; comment": "there are no inline comments",
		"7531":                     "missing port in address",
		"::1:7531":                 "too many colons",
		"bad_host!:7531":           "neither an IP address nor a host name",
		"127.0.0.1:":               `port "" is not a number`,
		"127.0.0.1:http":           `port "http" is not a number`,
	}
	for v, want := range bad {
		for _, c := range []struct{ section, key string }{{"poolcounter", "LISTEN"}, {"pepsi-dispatch", "METRICS_LISTEN"}} {
			got := loadErr(t, "# x\n["+c.section+"]\n"+c.key+" = "+v+"\n")
			if !strings.HasPrefix(got, "c.conf:3: "+c.key+": want host:port") || !strings.Contains(got, want) {
				t.Errorf("[%s] %s = %s: error %q\nwant c.conf:3: %s: want host:port … %s", c.section, c.key, v, got, c.key, want)
			}
		}
	}
	for _, v := range []string{"127.0.0.1:7531", ":7531", "[::1]:7531", "localhost:9187", "db-1.example.org:0", "0.0.0.0:65535"} {
		if got := loadErr(t, "[poolcounter]\nLISTEN = "+v+"\n[pepsi-dispatch]\nMETRICS_LISTEN = "+v+"\n"); got != "" {
			t.Errorf("%s rejected: %s", v, got)
		}
	}
}

// TestConfigLineLength (D4): a line of exactly 64 KiB is accepted, with "\n" or "\r\n"; one
// byte more is rejected, and the message names the line.
func TestConfigLineLength(t *testing.T) {
	long := func(n int) string { return "# " + strings.Repeat("x", n-2) }
	for _, eol := range []string{"\n", "\r\n"} {
		if got := loadErr(t, "[pepsi-dispatch]"+eol+long(iniMaxLine)+eol+"USER = nobody"+eol); got != "" {
			t.Errorf("line of exactly %d bytes (eol %q) rejected: %s", iniMaxLine, eol, got)
		}
		got := loadErr(t, "[pepsi-dispatch]"+eol+long(iniMaxLine+1)+eol)
		if !strings.HasPrefix(got, "c.conf:2: line longer than 65536 bytes") {
			t.Errorf("line of %d bytes (eol %q): error %q, want it to name line 2", iniMaxLine+1, eol, got)
		}
	}
	// Far too long (beyond the scanner's buffer), and as the file's last line without "\n".
	if got := loadErr(t, "[a]\n\n"+long(1<<20)+"\n"); !strings.HasPrefix(got, "c.conf:3: line longer than") {
		t.Errorf("1 MiB line: %q", got)
	}
	if got := loadErr(t, "[a]\n"+long(iniMaxLine+2)); !strings.HasPrefix(got, "c.conf:2: line longer than") {
		t.Errorf("last line of %d bytes without newline: %q", iniMaxLine+2, got)
	}
	if got := loadErr(t, "[a]\n"+long(iniMaxLine)); got != "" {
		t.Errorf("last line of exactly %d bytes without newline rejected: %s", iniMaxLine, got)
	}
}

// TestConfigByteOrderMark: a file an editor saved with a UTF-8 byte order mark (Windows'
// Notepad) reads as the same file without it. Its first line's section header was not seen,
// so the file's first key was "outside any [section]", or a whole section of ours was read
// as another program's. A mark anywhere else is text, and an error in a key of ours.
func TestConfigByteOrderMark(t *testing.T) {
	dir := testDir(t)
	plain := "[pepsi-dispatch]\r\nUSER = nobody\r\n[poolcounter]\r\nLISTEN = 127.0.0.1:0\r\n"
	want, err := loadConfig(writeFile(t, dir, "plain.conf", plain))
	if err != nil {
		t.Fatalf("the file without a mark: %v", err)
	}
	got, err := loadConfig(writeFile(t, dir, "bom.conf", "\uFEFF"+plain))
	if err != nil {
		t.Fatalf("the file with a byte order mark: %v", err)
	}
	if got.Dispatch.User != want.Dispatch.User || got.PoolCounter.Listen != want.PoolCounter.Listen {
		t.Errorf("with a byte order mark: USER %q, LISTEN %q; without: %q, %q",
			got.Dispatch.User, got.PoolCounter.Listen, want.Dispatch.User, want.PoolCounter.Listen)
	}
	if e := loadErr(t, "[pepsi-dispatch]\n\uFEFFUSER = nobody\n"); !strings.HasPrefix(e, "c.conf:2: ") {
		t.Errorf("a byte order mark on line 2: error %q, want one at c.conf:2", e)
	}
}

// TestConfigBinaryFile (D5): a binary file is rejected, and the message quotes what is not
// printable instead of sending it to the terminal, and stays short.
func TestConfigBinaryFile(t *testing.T) {
	for name, text := range map[string]string{
		"key outside a section": "\x7fELF\x02\x01\x01\x00\x1b[31m=\x00\x00\x03",
		"bad key in a section":  "[pepsi-dispatch]\n\x1b]0;pwned\x07KEY\x01 = 1\n",
		"long binary key":       strings.Repeat("\x00\x01\x02\xff", 8000) + "=x\n",
		"no equals sign":        "[database]\n\x1b[2J\x00\x00\x00\n",
		"header":                "[stage-\x1b[31m\n",
		"section name":          "[stage-a\x00]\nPROGRAM = p\n",
	} {
		got := loadErr(t, text)
		if got == "" {
			t.Errorf("%s: accepted", name)
			continue
		}
		if i := strings.IndexFunc(got, func(r rune) bool { return unicode.IsControl(r) || r == unicode.ReplacementChar }); i >= 0 {
			t.Errorf("%s: message carries raw control bytes: %q", name, got)
		}
		if len(got) > 300 {
			t.Errorf("%s: message of %d bytes: %.300q…", name, len(got), got)
		}
		if !strings.HasPrefix(got, "c.conf:") {
			t.Errorf("%s: message names no line: %q", name, got)
		}
	}
}

// TestConfigSmallMistakes (D7): a NUL (or another control character) in a value is an error
// that does not echo the value; -c DIR says what is wrong once.
func TestConfigSmallMistakes(t *testing.T) {
	for _, v := range []string{"nob\x00ody", "x\x01", "a\x7f"} {
		got := loadErr(t, "[pepsi-dispatch]\nUSER = "+v+"\n")
		if !strings.HasPrefix(got, "c.conf:2: USER: the value contains the control character U+00") || strings.Contains(got, "nob") {
			t.Errorf("USER = %q: %q", v, got)
		}
	}
	// A control character of two bytes (NEL, U+0085) is named, not its first byte (U+00C2).
	if got := loadErr(t, "[pepsi-dispatch]\nUSER = a\u0085b\n"); !strings.HasPrefix(got, "c.conf:2: USER: the value contains the control character U+0085 at byte 2;") {
		t.Errorf("NEL in a value: %q", got)
	}
	if got := loadErr(t, "[database]\nDSN = dbname=x password=s3cret\x00PW\n"); !strings.Contains(got, "c.conf:2: DSN: the value contains") || strings.Contains(got, "s3cret") {
		t.Errorf("NUL in DSN: %q", got)
	}
	if got := loadErr(t, "[pepsi-dispatch]\nUSER =\tnobody\t\n[stage-a]\nPROGRAM = p\nNEXT = \n[database]\nDSN = dbname=x\n"); got != "" {
		t.Errorf("tabs rejected: %s", got)
	}
	dir := testDir(t)
	_, err := loadConfig(dir)
	if err == nil || err.Error() != dir+": is a directory; -c names the configuration file" {
		t.Errorf("-c DIR: %v", err)
	}
}

// TestConfigDSNSyntax (D2, D6): a DSN that the driver cannot parse is a load-time error naming
// the DSN's line, in the user's words, never the password, and never the application_name
// the daemon appends.
func TestConfigDSNSyntax(t *testing.T) {
	const pw = "s3cretPW"
	for dsn, want := range map[string]string{
		"port=abc":                                  `wrong value for "port"`,
		"sslmode=bogus":                             `wrong value for "sslmode": "bogus" is not supported`,
		"dbname='mail":                              "unterminated quoted string literal",
		"dbname='mail password=" + pw:               "unterminated quoted string literal",
		"x dbname=mail password=" + pw:              `missing "=" after "x"`,
		"dbname=mail password=" + pw + " PW2 host=": `missing "=" after "[redacted]"`,
		"postgres://pepsi:" + pw + "@[bad/mail":     "not a valid postgres:// URL: missing ']' in host",
		"postgres://pepsi:" + pw + "@db1:abc/mail":  `not a valid postgres:// URL: invalid port ":abc" after host`,
		"postgres://pepsi:" + pw + "%zz@db1/mail":   "not a valid postgres:// URL",
		"postgres://pepsi:" + pw + "@db1/mail?sslmode=bogus&password=" + pw: `wrong value for "sslmode"`,
		"dbname=x\\": "missing character after backslash",
		// Quotes are part of a pepsi.conf value: a DSN written in quotes is refused as one,
		// lib/pq having read the quote into the first key (a setting it would send the server,
		// the host left to its default) or into a URL it no longer saw as one (whose error
		// quoted it, password and all). So is a URL lib/pq does not take for one.
		`"host=/run/postgresql dbname=mail password=` + pw + `"`: "starts with a quote",
		`"postgres://pepsi:` + pw + `@db1/mail"`:                 "starts with a quote",
		`'postgres://pepsi:` + pw + `@db1/mail'`:                 "starts with a quote",
		"POSTGRES://pepsi:" + pw + "@db1/mail":                   `missing "="`,
		"host=/run/postgresql d%bname=mail password=" + pw:       `"d%bname" is neither a connection keyword nor a setting's name`,
	} {
		got := loadErr(t, "[database]\n# the queue\nDSN = "+dsn+"\n")
		if !strings.HasPrefix(got, "c.conf:3: DSN: ") || !strings.Contains(got, want) {
			t.Errorf("DSN = %s:\n error %q\n want c.conf:3: DSN: …%s", dsn, got, want)
		}
		for _, leak := range []string{pw, "s3cret", "PW2", "zz@", "application_name"} {
			if strings.Contains(got, leak) {
				t.Errorf("DSN = %s: error %q contains %q", dsn, got, leak)
			}
		}
	}
	for _, dsn := range []string{"host=/run/postgresql dbname=mail", "postgres://pepsi:" + pw + "@db1:5433/mail?sslmode=verify-full", "",
		"dbname='mail' options='-c search_path=x'", "service_ignored_by_pq=1 dbname=x"} {
		if got := loadErr(t, "[database]\nDSN = "+dsn+"\n"); got != "" {
			t.Errorf("DSN = %s rejected: %s", dsn, got)
		}
	}
	// A setting of lib/pq's in the environment is blamed on the environment.
	t.Setenv("PGSSLMODE", "bogus")
	if got := loadErr(t, "[database]\nDSN = dbname=x\n"); !strings.Contains(got, "$PGSSLMODE") || !strings.Contains(got, "environment") {
		t.Errorf("PGSSLMODE=bogus: %q", got)
	}
}

// TestSSLModeDefault (issue 22): without an sslmode of its own the DSN gets libpq's default,
// prefer, for the dispatcher and the workers alike; a choice of the user's is kept.
func TestSSLModeDefault(t *testing.T) {
	t.Setenv("PGSSLMODE", "") // restored after the test, which needs it unset
	os.Unsetenv("PGSSLMODE")
	for in, want := range map[string]string{
		"host=db1 dbname=mail":                    "host=db1 dbname=mail sslmode='prefer'",
		"host=db1 sslmode=require":                "host=db1 sslmode=require",
		"host=db1 sslmode=disable":                "host=db1 sslmode=disable",
		"host=/run/postgresql":                    "host=/run/postgresql",
		"host=db1 sslrootcert=system":             "host=db1 sslrootcert=system",
		"postgres://u@db1/mail":                   "postgres://u@db1/mail?sslmode=prefer",
		"postgres://u@db1/mail?sslmode=verify-ca": "postgres://u@db1/mail?sslmode=verify-ca",
		"": "",
	} {
		if got := withSSLModeDefault(in); got != want {
			t.Errorf("withSSLModeDefault(%q) = %q, want %q", in, got, want)
		}
	}
	t.Setenv("PGSSLMODE", "disable")
	if got := withSSLModeDefault("host=db1"); got != "host=db1" {
		t.Errorf("with PGSSLMODE set: %q", got)
	}
}

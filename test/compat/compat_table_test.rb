# frozen_string_literal: true

require "test_helper"
require_relative "../../bin/lib/compat_table"

# bin/lib/compat_table.rb: the page bin/compat-table writes from the rows
# test/compat records.
class CompatTableTest < PlainTest
  def test_a_row_concurrent_everywhere_has_one_version_and_no_fix
    page = render(row("pg", ruby: "3.1.2", seconds: 0.71), row("pg", ruby: "3.4.11", seconds: 0.52))
    assert_includes page, "| Gem | Version tested | Ruby 3.1.2 | Ruby 3.4.11 | Fix where not concurrent |"
    assert_includes page, "| pg | 1.7.0 | concurrent, 0.71 s | concurrent, 0.52 s | not needed |"
    refute_includes page, "stall detector's warning for each"
  end

  def test_a_row_fixed_on_one_ruby_names_the_fix_and_shows_the_warning
    page = render(row("excon", ruby: "3.1.2", version: "1.6.0", fix: "io_select", warning: "held the loop\n  excon/socket.rb:368"),
                  row("excon", ruby: "3.4.11", version: "1.11.0"))
    assert_includes page, "| excon | 1.6.0 (3.1.2)<br>1.11.0 (3.4.11) | **blocks the loop** (2 calls: 1.00 s); " \
                          "with the fix: concurrent, 0.50 s | concurrent, 0.50 s | Ruby 3.1.2: the io_select text |"
    assert_match(/^### excon, Ruby 3\.1\.2\n\n#{Regexp.escape(CompatTable::SHOWN)}\n```\nheld the loop\n  excon\/socket.rb:368\n```$/, page)
  end

  # A fix for calls that take turns while the loop stays free: no warning.
  def test_a_row_whose_calls_take_turns_has_no_warning_section
    page = render(row("faraday (httpx adapter)", ruby: "3.1.2", fix: "connection_per_fiber"))
    assert_includes page, "**calls take turns** (2 calls: 1.00 s)"
    refute_includes page, "### faraday"
  end

  def test_rows_are_grouped_by_their_test_class_and_the_standard_library_says_so
    page = render(row("Resolv::DNS", ruby: "3.4.11", gem: nil, version: "stdlib", test: "CompatStdlibTest#test_resolv"),
                  row("pg", ruby: "3.4.11"))
    assert_operator page.index("## Databases and caches"), :<, page.index("## Standard library")
    assert_includes page, "| Resolv::DNS | stdlib | concurrent, 0.50 s | not needed |"
  end

  def test_a_ruby_without_the_row_says_not_run
    page = render(row("pg", ruby: "3.1.2"), row("trilogy", ruby: "3.4.11"))
    assert_includes page, "| pg | 1.7.0 | concurrent, 0.50 s | not run | not needed |"
  end

  # The YJIT Ruby (3.4.5) is older than the chroot's 3.4.11 but its column
  # stands beside 3.4's, after it, named as docs/benchmarks.md names it.
  def test_the_yjit_ruby_has_its_column_after_its_series
    page = render(row("pg", ruby: "3.4.5+YJIT", fix: "defer", warning: "held"), row("pg", ruby: "3.4.11"),
                  row("pg", ruby: "3.1.2", fix: "defer", warning: "held"))
    assert_includes page, "| Gem | Version tested | Ruby 3.1.2 | Ruby 3.4.11 | Ruby 3.4.5 + YJIT | Fix where not concurrent |"
    assert_includes page, "| Ruby 3.1.2, 3.4.5 + YJIT: the defer text |"
    assert_includes page, "test/compat on Ruby 3.1, 3.4, 3.4 + YJIT\n"
    assert_operator page.index("### pg, Ruby 3.1.2"), :<, page.index("### pg, Ruby 3.4.5 + YJIT")
  end

  def test_the_page_names_the_load_the_rows_ran_at
    page = render(row("pg", ruby: "3.1.2", load: 1.23), row("trilogy", ruby: "3.1.2", load: 4.56), row("redis", ruby: "3.1.2"))
    assert_includes page, "shared 2-core machine, load average 1.2-4.6 during the runs."
    refute_includes render(row("pg", ruby: "3.1.2")), "load average"
  end

  def test_a_note_is_listed_below_its_table_with_the_rubies_that_recorded_it
    note = "two exchanges a call"
    page = render(row("Resolv::DNS", ruby: "3.1.2"), row("Resolv::DNS", ruby: "3.4.11", note: note),
                  row("Resolv::DNS", ruby: "3.4.5+YJIT", note: note))
    assert_match(/\| not needed \|\n\n- \*\*Resolv::DNS\*\*, Ruby 3\.4\.11, 3\.4\.5 \+ YJIT: two exchanges a call\n/, page)
    refute_includes render(row("pg", ruby: "3.1.2")), "- **"
  end

  private

  def render(*results)
    CompatTable.new(results).render
  end

  def row(name, ruby:, version: "1.7.0", gem: "gem", seconds: 0.5, fix: nil, warning: nil,
          test: "CompatDatabasesTest#test_x", load: nil, note: nil)
    { "row" => name, "gem" => gem, "version" => version, "ruby" => ruby,
      "verdict" => fix ? "needs fix" : "concurrent", "seconds" => seconds, "fix" => fix,
      "fix_text" => fix && "the #{fix} text", "probe_seconds" => fix && 1.0, "warning" => warning, "test" => test,
      "load" => load, "note" => note }
  end
end

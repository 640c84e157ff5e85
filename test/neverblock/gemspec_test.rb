# frozen_string_literal: true

require "test_helper"

# What a new user's Gemfile line resolves to: the gemspec and the install
# lines of README.md and docs/*.md, checked against RubyGems' other `neverblock` (0.1.6.2,
# 2010, EventMachine).
class GemspecTest < PlainTest
  ROOT = File.expand_path("../..", __dir__)
  OLD_NEVERBLOCK = Gem::Version.new("0.1.6.2")

  def spec
    @spec ||= Dir.chdir(ROOT) { Gem::Specification.load("neverblock.gemspec") }
  end

  def test_the_version_is_the_2_line_above_the_2010_gem
    assert_equal NeverBlock::VERSION, spec.version.to_s
    assert_operator spec.version, :>=, Gem::Version.new("2.0.0.pre")
    assert_operator spec.version, :>, OLD_NEVERBLOCK
  end

  def test_runtime_dependencies_are_declared
    runtime = spec.runtime_dependencies.to_h { |dep| [dep.name, dep.requirement] }
    assert_equal %w[io-event llhttp rack], runtime.keys.sort
    assert runtime["rack"].satisfied_by?(Gem::Version.new("3.2.8"))
    assert runtime["rack"].satisfied_by?(Gem::Version.new("2.2.4"))
  end

  def test_metadata_and_files
    %w[source_code_uri changelog_uri bug_tracker_uri].each { |key| assert spec.metadata[key], key }
    %w[exe/neverblock lib/neverblock/railtie.rb lib/rackup/handler/neverblock.rb CHANGELOG.md README.md docs/server.md].each do |file|
      assert_includes spec.files, file
    end
    assert_equal ["neverblock"], spec.executables
  end

  # Every `gem "neverblock"` line in README.md and docs/*.md has a
  # requirement that the 2010 gem cannot satisfy and this version does.
  def test_every_documented_gemfile_line_excludes_the_2010_gem
    documents = ["README.md"] + Dir.glob("docs/*.md", base: ROOT).sort
    lines = documents.flat_map do |document|
      File.readlines(File.join(ROOT, document)).grep(/^\s*#?\s*gem "neverblock"/).map { |line| [document, line] }
    end
    refute_empty lines
    lines.each do |document, line|
      requirements = line.scan(/"([<>=~!]+ ?[\d.a-z]+)"/).flatten
      refute_empty requirements, "no version requirement in #{document} line: #{line}"
      requirement = Gem::Requirement.new(*requirements)
      refute requirement.satisfied_by?(OLD_NEVERBLOCK), line
      assert requirement.satisfied_by?(spec.version), line
    end
  end
end
